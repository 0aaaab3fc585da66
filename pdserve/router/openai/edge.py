"""The HTTP edge in front of the OpenAI routes: every error as an OpenAI error object, the
request body limit (however the body is sent), and the optional API key. Pure ASGI where
it must see the raw byte stream."""
from __future__ import annotations

import hmac
import json
import sys
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# OpenAI's error `type` per status (the Python client maps statuses to exception classes)
_TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}


def printable(text: str) -> str:
    """`text` with anything UTF-8 cannot carry (a client's lone surrogate echoed back) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": printable(message), "type": kind, "param": param, "code": code}}


def error(status: int, message: str, param: str | None = None, code: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def sse_error(status: int, message: str, code: str | None = None) -> str:
    """An error after the stream's 200 went out: one SSE event; the caller then sends [DONE]."""
    return f"data: {json.dumps(error_body(status, message, None, code))}\n\n"


def install_error_handlers(app: FastAPI) -> None:
    """Every error FastAPI or Starlette would answer in their own {"detail"} shape (invalid
    JSON or UTF-8, deep nesting, unknown route, wrong method, an unexpected exception) is
    answered as an OpenAI error object instead."""

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error(400, f"malformed JSON: {msg}")
        return error(400, f"{loc}: {msg}" if loc else msg, param=loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail, default=str)
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "malformed request body: not valid JSON in UTF-8, or nested too deeply"
        return error(exc.status_code, detail, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        print(f"router: {request.method} {request.url.path} failed: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        return error(500, f"internal error: {type(exc).__name__}")


async def _send_error(send: Send, status: int, message: str, code: str | None = None,
                      headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"connection", b"close")]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _keyed(path: str) -> bool:
    """Whether a route needs the API key: the ones that cost a tokenizer or a worker
    (/health, /metrics and /version stay open for load balancers and scrapers)."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


class EdgeMiddleware:
    """Pure ASGI: checks the API key on /v1/* and the tokenizer routes, then reads the whole request body, counting
    bytes of every `http.request` message (a chunked body has no Content-Length to trust),
    and answers 413 as soon as it passes `max_body_bytes`. The app sees the buffered body."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, api_key: str | None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and _keyed(scope["path"]) and not self._authorized(headers):
            return await _send_error(send, 401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                     "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await _send_error(send, 413, f"request body of {int(length)} bytes exceeds the limit of "
                                     f"{self.max_body_bytes} bytes", "body_too_large")
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away
                return
            size += len(msg.get("body", b""))
            if size > self.max_body_bytes:
                return await _send_error(send, 413, f"request body exceeds the limit of {self.max_body_bytes} "
                                         "bytes", "body_too_large")
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body, delivered = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the app expects

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key or b"")
