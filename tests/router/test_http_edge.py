"""The HTTP edge without a deployment: the API key, the body limit for chunked bodies, and
the OpenAI error shapes (router/openai/edge.py), on a small app behind the same middleware."""
from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pdserve.router.openai.edge import EdgeMiddleware, install_error_handlers, sse_error

JSON = {"content-type": "application/json"}


def _app(api_key: str | None = None, limit: int = 1024) -> TestClient:
    app = FastAPI()
    app.add_middleware(EdgeMiddleware, max_body_bytes=limit, api_key=api_key)
    install_error_handlers(app)

    @app.post("/v1/echo")
    async def echo(body: dict):
        return {"n": len(json.dumps(body))}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/tokenize")
    async def tokenize(body: dict):
        return {"tokens": []}

    @app.get("/v1/boom")
    async def boom():
        raise RuntimeError("bug")

    return TestClient(app, raise_server_exceptions=False)


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_api_key_guards_v1_and_the_tokenizer_routes():
    client = _app(api_key="s3cret")
    assert _error(client.post("/v1/echo", json={}), 401)["code"] == "invalid_api_key"
    assert client.post("/v1/echo", json={}).headers["www-authenticate"] == "Bearer"
    _error(client.post("/v1/echo", json={}, headers={"Authorization": "Bearer wrong"}), 401)
    _error(client.post("/v1/echo", json={}, headers={"Authorization": "Basic s3cret"}), 401)
    assert client.post("/v1/echo", json={"a": 1}, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/health").status_code == 200  # health checks need no key
    _error(client.post("/tokenize", json={}), 401)  # costs a tokenizer thread, as a request does
    assert client.post("/tokenize", json={}, headers={"Authorization": "Bearer s3cret"}).status_code == 200


@pytest.mark.parametrize("chunked", [False, True], ids=["content_length", "chunked"])
def test_body_limit_however_sent(chunked):
    client = _app(limit=1024)
    body = json.dumps({"x": "a" * 2000}).encode()
    content = (body[i:i + 100] for i in range(0, len(body), 100)) if chunked else body
    assert _error(client.post("/v1/echo", content=content, headers=JSON), 413)["code"] == "body_too_large"
    small = json.dumps({"x": "a" * 500}).encode()
    content = (small[i:i + 100] for i in range(0, len(small), 100)) if chunked else small
    assert client.post("/v1/echo", content=content, headers=JSON).status_code == 200


def test_framework_errors_are_openai_errors():
    client = _app()
    _error(client.get("/v1/nowhere"), 404)
    _error(client.get("/v1/echo"), 405)
    _error(client.post("/v1/echo", content=b"{bad"), 400)
    _error(client.post("/v1/echo", content=b'{"x": "\xff"}'), 400)
    err = _error(client.get("/v1/boom"), 500)
    assert err["type"] == "server_error" and "bug" not in err["message"]  # no internals leak


def test_sse_error_event_is_an_openai_error():
    line = sse_error(502, "decode worker lost \ud800", "worker_failed")
    assert line.startswith("data: ") and line.endswith("\n\n")
    err = json.loads(line[6:])["error"]
    assert err["code"] == "worker_failed" and err["type"] == "server_error"
    line.encode("utf-8")  # a client's lone surrogate echoed back cannot break the stream
