"""A client that goes away releases its blocks on P and D within a bounded time: an HTTP
client that closes its stream, and a ZeroMQ client that heartbeats and then falls silent
(a ROUTER socket does not report disconnects; docs/protocol.md)."""
from __future__ import annotations

import json
import re
import time
import urllib.request

import msgpack
import zmq

from pdserve.common.wire.messages import PROTOCOL_VERSION
from tests.support.reliability_harness import serve, stop, wait_blocks_baseline

LONG = 2000  # tokens, at >= 5 ms each (an injected slow decode step): far longer than each client stays
SLOW_DECODE = "delay_step_ms=5@decode-0"  # the tiny model alone decodes 2000 tokens in ~2 s, as fast as an abort


def aborted(served) -> float:
    text = urllib.request.urlopen(served.base + "/metrics", timeout=10).read().decode()
    m = re.search(r'^pdserve_requests_total\{outcome="aborted"\} ([\d.e+-]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_aborted_and_released(served, n: int, why: str) -> None:
    """Until the router has aborted `n` requests in all (15 s at most), then until every
    worker's blocks are back to baseline."""
    t0 = time.monotonic()
    while aborted(served) < n and time.monotonic() - t0 < 15:
        time.sleep(0.1)
    assert aborted(served) == n, why
    wait_blocks_baseline(served, ["prefill-0", "decode-0"], timeout=20)


def test_http_and_zmq_clients_going_away(tmp_path, prompts):
    served = serve(tmp_path, ["--prefill", "1", "--decode", "1"], faults=SLOW_DECODE, extra=("--client-timeout", "2"),
                   max_model_len=2048)
    try:
        body = json.dumps({"prompt": prompts[0], "max_tokens": LONG, "temperature": 0,
                           "stream": True, "ignore_eos": True}).encode()
        req = urllib.request.Request(served.http + "/completions", body, {"Content-Type": "application/json"})
        resp = urllib.request.urlopen(req, timeout=60)
        resp.readline()  # the first chunk: it is decoding
        resp.close()
        t0 = time.monotonic()
        wait_aborted_and_released(served, 1, "the HTTP client's request was not aborted")
        http_s = time.monotonic() - t0

        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(served.zmq)
        pack = lambda t, d: msgpack.packb({"v": PROTOCOL_VERSION, "type": t, "data": d})  # noqa: E731
        sock.send(pack("client_heartbeat", {"interval_s": 1.0}))
        sock.send(pack("submit", {"request_id": "gone", "prompt_token_ids": prompts[1],
                                  "sampling": {"max_tokens": LONG, "temperature": 0, "ignore_eos": True}}))
        assert sock.poll(60_000)
        sock.recv()  # decoding has begun; now the client goes silent for good
        sock.close(0)
        ctx.term()
        t0 = time.monotonic()
        wait_aborted_and_released(served, 2, "the silent ZeroMQ client's request was not aborted")
        print(f"released after: http {http_s:.2f} s, zmq {time.monotonic() - t0:.2f} s")
    finally:
        stop(served)
