"""The router core (router/core/router.py) in-process, against fake workers made of bare ZeroMQ
sockets: what reaches a worker, what comes back to the caller, and what happens when a
worker dies or comes back at another address."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses


from pdserve.common.clock import ManualClock
from pdserve.common.wire import messages
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.messages import (AbortRequest, ErrorReply, GenerateRequest, RequestOutput, SubmitRequest,
                                  TokenOutput, WorkerStatus)
from tests.support.router_harness import FakeWorker, Harness, collect, run, step, submit  # noqa: F401


def test_request_goes_to_the_worker_and_tokens_come_back(model_dirs):
    async def scenario():
        h = Harness(model_dirs["qwen3"])
        try:
            w = await h.registered("c0")
            job = asyncio.create_task(collect(h.router, submit("r1")))
            identity, req = await w.next_request()
            assert isinstance(req, GenerateRequest)
            assert (req.request_id, req.prompt_token_ids, req.prefill_addr) == ("r1", [5, 6, 7], "")
            assert h.router._queued_blocks() == {"c0": 1}  # its prompt's one block, not yet computed
            assert req.return_timeline and list(req.timeline) == ["arrival", "routed"]
            text_ids = h.router.tokenizer.encode("hello world")
            await w.reply(identity, step(RequestOutput("r1", text_ids[:1])))
            await w.reply(identity, step(RequestOutput("r1", text_ids[1:], finished=True, finish_reason="length",
                                                       timeline=dict(req.timeline, finish=req.timeline["routed"]))))
            outs = await job
            # outputs already queued together are relayed as one message: compare the stream's content
            assert [t for o in outs for t in o.token_ids] == text_ids
            assert "".join(o.text for o in outs) == "hello world"
            assert outs[-1].finished and outs[-1].num_prompt_tokens == 3
            assert list(outs[-1].timeline) == ["arrival", "routed", "finish", "router_done"]
            assert h.router.inflight == {} and h.router.registry.workers["c0"].inflight == 0
            assert h.router._queued_blocks() == {}
        finally:
            await h.close()

    run(scenario())


def test_inflight_request_fails_when_its_worker_goes_silent(model_dirs):
    async def scenario():
        h = Harness(model_dirs["qwen3"], stale_after_s=0.4)
        try:
            w = await h.registered("c0")
            job = asyncio.create_task(collect(h.router, submit("r1")))
            assert await w.next_request() is not None  # received, never answered, no heartbeats
            outs = await asyncio.wait_for(job, 10)
            assert len(outs) == 1 and isinstance(outs[0], ErrorReply)
            assert outs[0].code == "worker_failed" and "c0" in outs[0].message
            (err,) = await collect(h.router, submit("r2"))
            assert isinstance(err, ErrorReply) and err.code == "unavailable"
        finally:
            await h.close()

    run(scenario())


def test_restarted_worker_gets_requests_at_its_new_address(model_dirs):
    """The registry treats a hello from a known worker id at a new address as a restart
    (a fresh entry), so the router must send that worker's requests to the new address."""
    async def scenario():
        h = Harness(model_dirs["qwen3"], stale_after_s=0.4)
        try:
            old = h.worker("c0")
            await h.send(old.hello())
            await h.router.wait_for_workers(0, 0, 1, timeout=5)
            old.sock.close(0)  # the worker dies ...
            await asyncio.sleep(0.8)
            assert h.router.registry.live(("colocated",)) == []
            new = h.worker("c0")  # ... and comes back on another port
            await h.send(new.hello())
            await h.send(WorkerStatus("c0", "colocated", 0, 0, 64, 64))
            await h.router.wait_for_workers(0, 0, 1, timeout=5)
            assert h.router.registry.workers["c0"].hello.address == new.address
            job = asyncio.create_task(collect(h.router, submit("r1")))
            got = await new.next_request(timeout_s=3)
            if got is None:
                job.cancel()
            assert got is not None, "the request did not reach the restarted worker's new address"
            identity, req = got
            await new.reply(identity, step(RequestOutput("r1", [9], finished=True, finish_reason="length")))
            assert (await job)[-1].finished
        finally:
            await h.close()

    run(scenario())


def test_worker_of_another_model_or_block_size_is_refused(model_dirs, capfd):
    """A worker whose block size or model differs from the router's would break prefix
    routing silently: the router logs why and neither registers nor routes to it."""
    async def scenario():
        h = Harness(model_dirs["qwen3"])
        try:
            other_model = h.worker("c-model")
            other_block = h.worker("c-block")
            other_dtype = h.worker("c-bf16")  # the router's model at bfloat16 (the router's is float32)
            good = h.worker("c-good")
            await h.send(dataclasses.replace(other_model.hello(), model_fingerprint="0123456789abcdef"))
            await h.send(dataclasses.replace(other_dtype.hello(), model_fingerprint=h.router.model_fingerprint.replace(
                ":float32", ":bfloat16")))
            await h.send(dataclasses.replace(other_block.hello(), block_size=32))
            await h.send_raw(messages.encode(WorkerStatus("c-model", "colocated", 0, 0, 64, 64))[:5])  # malformed
            await h.send(good.hello())
            await h.router.wait_for_workers(0, 0, 1, timeout=5)
            assert set(h.router.registry.workers) == {"c-good"}
            await h.send(WorkerStatus("c-model", "colocated", 0, 0, 64, 64))  # heartbeats do not register it
            job = asyncio.create_task(collect(h.router, submit("r1")))
            assert await good.next_request() is not None
            job.cancel()
            assert await other_model.next_request(timeout_s=0.3) is None
            assert set(h.router.registry.workers) == {"c-good"}
        finally:
            await h.close()

    run(scenario())
    err = capfd.readouterr().err
    assert "refused colocated worker c-model" in err and "model fingerprint '0123456789abcdef'" in err
    assert "refused colocated worker c-block" in err and "block_size 32 (router: 16)" in err
    assert "refused colocated worker c-bf16" in err and "dtype bfloat16 (router: float32" in err
    assert "router: dropped a malformed control message" in err


def test_one_step_message_feeds_every_request_in_it(model_dirs):
    """A worker's StepOutputs holds entries of several requests: each reaches its own
    caller, as client TokenOutputs with their text."""
    async def scenario():
        h = Harness(model_dirs["qwen3"])
        try:
            w = await h.registered("c0")
            jobs = {rid: asyncio.create_task(collect(h.router, submit(rid))) for rid in ("r1", "r2")}
            identity, _ = await w.next_request()
            await w.next_request()
            ids = {rid: h.router.tokenizer.encode(text) for rid, text in (("r1", "hello world"), ("r2", "the model"))}
            await w.reply(identity, step(RequestOutput("r1", ids["r1"][:1]), RequestOutput("r2", ids["r2"][:1])))
            await w.reply(identity, step(*(RequestOutput(rid, ids[rid][1:], finished=True, finish_reason="length")
                                           for rid in ("r2", "r1"))))
            for rid, text in (("r1", "hello world"), ("r2", "the model")):
                outs = await jobs[rid]
                assert all(isinstance(o, TokenOutput) for o in outs)
                assert [t for o in outs for t in o.token_ids] == ids[rid] and "".join(o.text for o in outs) == text
                assert outs[-1].finished and outs[-1].finish_reason == "length"
        finally:
            await h.close()

    run(scenario())


def test_stop_string_ends_the_request_and_aborts_the_worker(model_dirs):
    """The router's detokenizer sees the stop string complete: the caller's stream ends
    with "stop", the text cut before it, the tokens up to the one that completed it; the
    worker is told to abort, and what it still sends is dropped."""
    async def scenario():
        h = Harness(model_dirs["qwen3"])
        try:
            w = await h.registered("c0")
            tok = h.router.tokenizer
            ids = [t for word in ("the", " model", " serving", " request", " token") for t in tok.encode(word)]
            stop_at = len(tok.encode("the")) + len(tok.encode(" model")) + len(tok.encode(" serving"))
            sub = SubmitRequest("r1", SamplingParams(temperature=0, max_tokens=20, stop=["ving req", "zzz"]),
                                prompt_token_ids=[5, 6, 7])
            job = asyncio.create_task(collect(h.router, sub))
            identity, _ = await w.next_request()
            # the stop string completes in the first token of " request", mid-message
            await w.reply(identity, step(RequestOutput("r1", ids[:2])))
            await w.reply(identity, step(RequestOutput("r1", ids[2:])))
            outs = await job
            assert outs[-1].finished and outs[-1].finish_reason == "stop"
            assert "".join(o.text for o in outs) == "the model ser"
            assert [t for o in outs for t in o.token_ids] == ids[:stop_at + 1]
            got = await w.next_request()
            assert got is not None and isinstance(got[1], AbortRequest) and got[1].request_id == "r1"
            await w.reply(identity, step(RequestOutput("r1", [5], finished=True, finish_reason="abort")))
            assert h.router.inflight == {} and h.router.registry.workers["c0"].inflight == 0
            assert h.router.metrics.requests.labels("stop")._value.get() >= 1
        finally:
            await h.close()

    run(scenario())


def test_a_stop_string_finish_still_returns_the_workers_timeline(model_dirs):
    """Only the router sees a stop string; the worker's stamps travel with its answer to
    the abort, and a request that asked for its timeline gets them."""
    async def scenario():
        h = Harness(model_dirs["qwen3"])
        try:
            w = await h.registered("c0")
            ids = h.router.tokenizer.encode("say STOP now")
            sub = SubmitRequest("r1", SamplingParams(temperature=0, max_tokens=20, stop=["STOP"]),
                                prompt_token_ids=[5, 6, 7], return_timeline=True)
            job = asyncio.create_task(collect(h.router, sub))
            identity, req = await w.next_request()
            await w.reply(identity, step(RequestOutput("r1", ids)))
            got = await w.next_request()
            assert got is not None and isinstance(got[1], AbortRequest)
            stamps = dict(req.timeline, decode_arrival=1.0, first_token=2.0, finish=3.0)
            await w.reply(identity, step(RequestOutput("r1", [], finished=True, finish_reason="abort", timeline=stamps)))
            outs = await job
            assert outs[-1].finish_reason == "stop" and "".join(o.text for o in outs) == "say "
            assert outs[-1].timeline is not None
            assert list(outs[-1].timeline) == ["arrival", "routed", "decode_arrival", "first_token", "finish",
                                               "router_done"]
        finally:
            await h.close()

    run(scenario())


def test_a_silent_worker_is_dead_when_the_routers_clock_says_so(model_dirs):
    """The router's timers read its clock: driven by a ManualClock, a worker that stops
    heart-beating is taken out of rotation once that clock passes stale_after_s, and not
    a moment of it before, however long the test really takes."""
    async def scenario():
        clock = ManualClock()
        h = Harness(model_dirs["qwen3"], stale_after_s=2.0, clock=clock)
        try:
            w = h.worker("c0")
            await h.send(w.hello())
            for _ in range(500):  # the hello crosses a real socket
                if "c0" in h.router.registry.workers:
                    break
                await asyncio.sleep(0.01)
            entry = h.router.registry.workers["c0"]
            clock.advance(1.9)
            for _ in range(5):
                await asyncio.sleep(0)
            assert entry.alive, "expired before the router's clock passed stale_after_s"
            clock.advance(0.7)  # 2.6 s after its hello, and past the expiry loop's next wake-up
            for _ in range(5):
                await asyncio.sleep(0)
            assert not entry.alive
            assert h.router.registry.live(("colocated",)) == []
        finally:
            await h.close()
    run(scenario())


def test_a_grammar_that_does_not_compile_is_refused_before_any_worker(model_dirs):
    """Through the ZeroMQ front end and router/client.py: a bad regex or JSON schema is
    refused by the router with the compiler's reason; the worker never hears of it, while
    a good grammar reaches it."""
    from pdserve.router.client import AsyncClient, ServerError
    from pdserve.router.core.zmq_frontend import ZmqFrontend

    async def scenario():
        h = Harness(model_dirs["qwen3"])
        front = ZmqFrontend(h.router, "tcp://127.0.0.1:0")
        front.start()
        client = AsyncClient(front.address)
        try:
            w = await h.registered("c0")
            for kind, spec, reason in [("regex", "a(", "regex"), ("json", '{"type": 5}', "json")]:
                try:
                    await client.generate([5, 6, 7], max_tokens=2, structured={"kind": kind, "spec": spec})
                    raise AssertionError("a grammar that does not compile was served")
                except ServerError as e:
                    assert str(e).startswith(f"sampling.structured ({reason}) does not compile: "), str(e)
                assert await w.next_request(timeout_s=0.3) is None
            good = asyncio.create_task(client.generate([5, 6, 7], max_tokens=2,
                                                       structured={"kind": "regex", "spec": "[ab]+"}))
            _, req = await w.next_request()
            assert req.sampling.structured.spec == "[ab]+"
            good.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await good
        finally:
            await client.close()
            front.close()
            await h.close()

    run(scenario())
