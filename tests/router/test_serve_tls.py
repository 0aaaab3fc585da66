"""`pdserve serve` with its front ends encrypted -- HTTP over TLS (--ssl-keyfile /
--ssl-certfile, a self-signed certificate made here), the client ZeroMQ socket over
CurveZMQ (--zmq-curve) -- and CurveZMQ between the router and the workers it launches:
clients that trust the certificate / pin the printed server key get greedy output equal
to transformers'; one that does not, or that speaks in clear, gets nothing. Bad TLS flags
are refused before any worker starts."""
from __future__ import annotations

import contextlib
import signal
import ssl
import subprocess
import sys

import httpx
import msgpack
import openai
import pytest
import zmq

from pdserve.common.config import ConfigError
from pdserve.common.wire.messages import PROTOCOL_VERSION
from pdserve.router.core.config import RouterConfig
from pdserve.router.client import Client
from tests.support.serving import MAX_MODEL_LEN, MAX_NEW, PROMPTS, ROOT, RawClient, start_server, stop_server

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")


def self_signed(tmp_path) -> tuple[str, str]:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return str(key), str(cert)


def test_https_and_curve_serve_greedy(model_dir, tok, hf_greedy, tmp_path):
    key, cert = self_signed(tmp_path)
    served = start_server(model_dir, tmp_path, ["--prefill", "1", "--decode", "1"], MAX_MODEL_LEN,
                          extra=("--ssl-keyfile", key, "--ssl-certfile", cert, "--curve", "on", "--zmq-curve"))
    try:
        assert served.http.startswith("https://127.0.0.1:") and served.info["curve"] is True
        with httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=60) as http:
            client = openai.OpenAI(base_url=served.http, api_key="unused", max_retries=0, http_client=http)
            res = client.completions.create(model="qwen3", prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0)
        assert res.choices[0].token_ids == hf_greedy(model_dir, tok.encode(PROMPTS[0]), MAX_NEW)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{served.base}/health", timeout=10)  # the system's CAs do not know this certificate
        with pytest.raises(httpx.HTTPError):
            httpx.get(served.base.replace("https://", "http://") + "/health", timeout=10)

        server_key = served.info["zmq_server_key"]
        assert server_key and server_key in served.log.read_text()  # printed for clients to pin
        with Client(served.zmq, timeout_s=60, server_key=server_key) as zc:
            done = zc.generate(PROMPTS[1], max_tokens=MAX_NEW, temperature=0)
        assert done.token_ids == hf_greedy(model_dir, tok.encode(PROMPTS[1]), MAX_NEW)
        plain = RawClient(served.zmq)
        try:
            with contextlib.suppress(zmq.Again):  # after the failed handshake libzmq may have dropped the pipe
                plain.sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "type": "submit", "data": {
                    "request_id": "plain", "prompt": PROMPTS[1], "sampling": {"max_tokens": 2}}}), zmq.NOBLOCK)
            assert not plain.sock.poll(2000)  # a client in clear is never answered
        finally:
            plain.close()
    except BaseException:
        with contextlib.suppress(Exception):
            stop_server(served, signal.SIGTERM)
        raise
    stop_server(served, signal.SIGTERM)


def test_a_key_without_a_certificate_is_refused(model_dir):
    with pytest.raises(ConfigError, match="both ssl_keyfile and ssl_certfile"):
        RouterConfig(model_dir=model_dir, ssl_keyfile="key.pem")
    with pytest.raises(ConfigError, match="needs TLS on"):
        RouterConfig(model_dir=model_dir, ssl_ca_certs="ca.pem")


def test_an_unreadable_certificate_stops_serve_before_any_worker(model_dir, tmp_path):
    bogus = tmp_path / "bogus.pem"
    bogus.write_text("not a certificate")
    run = subprocess.run([sys.executable, "-m", "pdserve", "serve", model_dir, "--http-port", "0", "--zmq-port",
                          "0", "--ssl-keyfile", str(bogus), "--ssl-certfile", str(bogus), "--num-threads", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "cannot serve HTTP over TLS" in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "worker" not in run.stdout
