"""Degraded modes of the router core (router/core/routing.py, router/core/hold.py), in-process
against fake workers made of bare ZeroMQ sockets: prompts prefilled on a decode worker
when no prefill worker is left, and back via a prefill worker when one registers; a retry
that never returns to the worker that failed it, whose decode worker hears an abort at
once; suspicion on a closed connection; requests held for a worker up to their deadline,
inside the admission limit; and what HTTP answers meanwhile (/health, /metrics, 503 +
Retry-After before a stream's 200)."""
from __future__ import annotations

import asyncio
import contextlib
import json

import httpx

from pdserve.common.clock import ManualClock
from pdserve.common.hashing import block_hashes
from pdserve.common.wire.messages import (AbortRequest, ErrorReply, GenerateRequest, RequestOutput, TokenOutput,
                                          WorkerStatus)
from pdserve.router.openai.server import OpenAIServer
from tests.support.router_harness import FakeWorker, Harness, collect, run, step, submit


def counter(h: Harness, name: str, **labels: str) -> float:
    return h.router.metrics.registry.get_sample_value(name, labels) or 0.0


async def answer(w: FakeWorker, identity: bytes, wire_id: str, ids: list[int]) -> None:
    await w.reply(identity, step(RequestOutput(wire_id, ids, finished=True, finish_reason="length")))


async def until(cond, what: str, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


def tokens(outs: list) -> list[int]:
    assert all(isinstance(o, TokenOutput) for o in outs), outs
    return [t for o in outs for t in o.token_ids]


def test_no_prefill_worker_left_the_decode_worker_prefills_and_routing_returns_to_p_by_itself(model_dirs):
    async def scenario():
        h = Harness(model_dirs["qwen3"])
        try:
            d0 = await h.registered("d0", "decode")
            assert h.router.serving_state() == "degraded"
            job = asyncio.create_task(collect(h.router, submit("r1")))
            identity, req = await d0.next_request()
            assert isinstance(req, GenerateRequest) and req.prefill_addr == ""  # D computes it
            assert "route_local" in req.timeline  # the timeline says where the prompt went
            await answer(d0, identity, "r1", [9, 10])
            assert tokens(await job) == [9, 10]
            assert counter(h, "pdserve_degraded_requests_total", reason="no_prefill") == 1

            p0 = await h.registered("p0", "prefill")  # a prefill worker is back: nothing to configure
            assert h.router.serving_state() == "ok"
            job = asyncio.create_task(collect(h.router, submit("r2")))
            identity, req = await d0.next_request()
            assert req.prefill_addr == p0.address
            await answer(d0, identity, "r2", [11])
            assert tokens(await job) == [11]
            assert counter(h, "pdserve_degraded_requests_total", reason="no_prefill") == 1
        finally:
            await h.close()
    run(scenario())


def test_prefill_death_before_the_first_token_reprefills_on_decode_and_aborts_the_old_attempt(model_dirs):
    """The request's prefill worker exits with no other left: its decode worker is told to
    drop the old attempt at once, and gets the request again to prefill itself; the
    client sees the tokens and no error."""
    async def scenario():
        h = Harness(model_dirs["qwen3"])
        try:
            p0 = await h.registered("p0", "prefill")
            d0 = await h.registered("d0", "decode")
            job = asyncio.create_task(collect(h.router, submit("r1")))
            _, first = await d0.next_request()
            assert first.prefill_addr == p0.address
            h.router.worker_exited("p0", "exited with code -9")
            _, abort = await d0.next_request()
            assert isinstance(abort, AbortRequest) and abort.request_id == "r1"
            identity, again = await d0.next_request()
            assert isinstance(again, GenerateRequest) and again.request_id == "r1~retry1" and again.prefill_addr == ""
            await answer(d0, identity, again.request_id, [4, 5])
            assert tokens(await job) == [4, 5]
            assert counter(h, "pdserve_request_recoveries_total", kind="reprefill") == 1
            assert h.router.inflight == {} and h.router.registry.workers["d0"].inflight == 0
        finally:
            await h.close()
    run(scenario())


PROMPT = list(range(5, 45))  # 40 tokens: two full blocks a prefix cache can match


def test_a_retry_never_returns_to_the_worker_that_failed_it(model_dirs):
    """c0 holds the prompt's prefix, so routing prefers it; it fails the request
    (transfer_error): the retry goes to c1 all the same, and c0 hears an abort for the
    failed attempt at once. c0 is not suspected for that (its connection is fine)."""
    async def scenario():
        h = Harness(model_dirs["qwen3"])
        try:
            c0, c1 = await h.registered("c0"), await h.registered("c1")
            hashes = block_hashes(PROMPT, 16)[:2]
            await h.send(WorkerStatus("c0", "colocated", 0, 0, 64, 64, kv_stored=hashes))
            await until(lambda: h.router.registry.workers["c0"].cached == set(hashes), "no heartbeat")
            job = asyncio.create_task(collect(h.router, submit("r1", PROMPT)))
            identity, req = await c0.next_request()  # the prefix draws it
            await c0.reply(identity, ErrorReply("r1", "KV transfer corrupt", "transfer_error"))
            _, abort = await c0.next_request()
            assert isinstance(abort, AbortRequest) and abort.request_id == "r1"
            identity1, again = await c1.next_request()
            assert again.request_id == "r1~retry1"
            await answer(c1, identity1, again.request_id, [7])
            assert tokens(await job) == [7]
            assert h.router.suspected() == []
            job = asyncio.create_task(collect(h.router, submit("r2", PROMPT)))  # a new request may go back to c0
            identity, req = await c0.next_request()
            await answer(c0, identity, "r2", [8])
            assert tokens(await job) == [8]
        finally:
            await h.close()
    run(scenario())


def test_a_worker_reported_failed_is_suspected_until_it_heartbeats(model_dirs):
    """c0's request fails with worker_failed (a connection error): the retry goes to c1,
    and c0 gets no new request, whatever the round robin says, until it heartbeats."""
    async def scenario():
        h = Harness(model_dirs["qwen3"], routing="round_robin")
        try:
            c0, c1 = await h.registered("c0"), await h.registered("c1")
            job = asyncio.create_task(collect(h.router, submit("r1")))
            identity, req = await c0.next_request()  # round robin, in id order: c0 first
            await c0.reply(identity, ErrorReply("r1", "lost its peer", "worker_failed"))
            _, abort = await c0.next_request()
            assert isinstance(abort, AbortRequest) and abort.request_id == "r1"
            identity1, again = await c1.next_request()
            await answer(c1, identity1, again.request_id, [7])
            assert tokens(await job) == [7]
            assert [e.worker_id for e in h.router.suspected()] == ["c0"]
            for rid in ("r2", "r3"):  # the round robin would alternate: c0 is left out
                job = asyncio.create_task(collect(h.router, submit(rid)))
                identity1, req = await c1.next_request()
                await answer(c1, identity1, rid, [1])
                await job
            assert await c0.next_request(timeout_s=0.2) is None
            await h.send(WorkerStatus("c0", "colocated", 0, 0, 64, 64))  # heard again
            await until(lambda: h.router.suspected() == [], "a heartbeat did not clear the suspicion")
        finally:
            await h.close()
    run(scenario())


def test_a_worker_whose_connection_closes_is_suspected_at_once(model_dirs):
    async def scenario():
        h = Harness(model_dirs["qwen3"], routing="round_robin")
        try:
            c0, c1 = await h.registered("c0"), await h.registered("c1")
            await until(lambda: all(h.router.worker_socks.get(w) for w in ("c0", "c1")), "no sockets")
            await asyncio.sleep(0.3)  # both connections up
            c0.sock.close(0)  # its process died: the connection closes
            entry = h.router.registry.workers["c0"]
            await until(lambda: entry.connection_error != "", "a closed connection was not noticed")
            assert entry.alive  # suspected, not dead
            for rid in ("r1", "r2"):
                job = asyncio.create_task(collect(h.router, submit(rid)))
                identity, req = await c1.next_request()
                await answer(c1, identity, rid, [1])
                await job
        finally:
            await h.close()
    run(scenario())


def test_a_request_nothing_can_serve_waits_for_a_worker_to_register(model_dirs):
    async def scenario():
        h = Harness(model_dirs["qwen3"], worker_wait_s=30)
        try:
            job = asyncio.create_task(collect(h.router, submit("r1")))
            await until(lambda: h.router.waits.held == 1, "the request was not held")
            assert h.router.busy == 1 and h.router.serving_state() == "unavailable"
            c0 = await h.registered("c0")
            identity, req = await c0.next_request()
            assert req.request_id == "r1"
            await answer(c0, identity, "r1", [3])
            assert tokens(await job) == [3]
            assert h.router.waits.held == 0 and counter(h, "pdserve_degraded_requests_total", reason="held") == 1
        finally:
            await h.close()
    run(scenario())


def test_the_hold_ends_in_unavailable_with_retry_after_at_its_deadline(model_dirs):
    """Driven by the router's clock: not refused a moment before worker_wait_s, refused
    after it, and the error says when to try again."""
    async def scenario():
        clock = ManualClock()
        h = Harness(model_dirs["qwen3"], clock=clock, worker_wait_s=5.0)
        try:
            job = asyncio.create_task(collect(h.router, submit("r1")))
            await until(lambda: h.router.waits.held == 1, "the request was not held")
            clock.advance(4.9)
            for _ in range(10):
                await asyncio.sleep(0)
            assert not job.done() and h.router.waits.held == 1
            clock.advance(0.2)
            (err,) = await asyncio.wait_for(job, 5)
            assert isinstance(err, ErrorReply) and err.code == "unavailable", err
            assert "none registered within 5 s" in err.message and "retry after 1 s" in err.message
            assert h.router.waits.held == 0 and h.router.busy == 0
        finally:
            await h.close()
    run(scenario())


def test_requests_held_for_a_worker_count_against_admission(model_dirs):
    async def scenario():
        h = Harness(model_dirs["qwen3"], worker_wait_s=30, max_inflight=2)
        jobs = []
        try:
            jobs = [asyncio.create_task(collect(h.router, submit(f"r{i}"))) for i in range(2)]
            await until(lambda: h.router.waits.held == 2, "the requests were not held")
            (err,) = await asyncio.wait_for(collect(h.router, submit("r2")), 5)
            assert isinstance(err, ErrorReply) and err.code == "overloaded"  # never an unbounded queue
        finally:
            for j in jobs:
                j.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await j
            assert h.router.waits.held == 0  # a caller that goes away while held frees its slot
            await h.close()
    run(scenario())


def test_http_says_degraded_and_answers_503_with_retry_after_before_a_streams_200(model_dirs):
    async def scenario():
        h = Harness(model_dirs["qwen3"], worker_wait_s=0.3)
        server = OpenAIServer(h.router)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t") as http:
                health = await http.get("/health")
                assert health.status_code == 503 and health.json()["status"] == "unavailable"
                for stream in (True, False):
                    r = await http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2,
                                                                 "stream": stream})
                    assert r.status_code == 503 and r.headers["retry-after"] == "1", (stream, r.text)
                    assert r.json()["error"]["code"] == "unavailable"
                await h.registered("d0", "decode")
                await h.send(WorkerStatus("d0", "decode", 0, 0, 64, 64))
                health = await http.get("/health")
                body = health.json()
                assert health.status_code == 200 and body["status"] == "degraded" and "degraded" in body, body
                assert body["suspected"] == [] and body["workers"]["decode"] == 1
                text = (await http.get("/metrics")).text
                assert "pdserve_degraded 1.0" in text and "pdserve_unavailable 0.0" in text, text
                assert "pdserve_requests_held 0.0" in text
                await h.registered("p0", "prefill")
                assert (await http.get("/health")).json()["status"] == "ok"
                assert "pdserve_degraded 0.0" in (await http.get("/metrics")).text
                json.dumps(body)  # the body is plain JSON
        finally:
            await h.close()
    run(scenario())
