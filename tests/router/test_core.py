"""The router core (router/core.py) in-process, against fake workers made of bare ZeroMQ
sockets: what reaches a worker, what comes back to the caller, and what happens when a
worker dies or comes back at another address."""
from __future__ import annotations

import asyncio
import dataclasses

import zmq
import zmq.asyncio

from common.wire import messages
from common.sampling_params import SamplingParams
from common.wire.messages import ErrorReply, GenerateRequest, SubmitRequest, TokenOutput, WorkerHello, WorkerStatus
from common.wire.transport import Authenticator, bind_address
from router.config import RouterConfig
from router.core import Router


class FakeWorker:
    """A colocated worker's server socket; answers nothing unless told to."""

    def __init__(self, ctx: zmq.asyncio.Context, worker_id: str, fingerprint: str, auth: Authenticator) -> None:
        self.worker_id = worker_id
        self.auth = auth  # signs with the router's deployment secret, as a launched worker would
        self.fingerprint = fingerprint  # the router refuses a worker of another model
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = bind_address(self.sock, "tcp://127.0.0.1:0")

    def hello(self) -> WorkerHello:
        return WorkerHello(self.worker_id, "colocated", self.address, "cpu", total_blocks=64, block_size=16,
                           model_fingerprint=self.fingerprint)

    async def next_request(self, timeout_s: float = 5.0) -> tuple[bytes, GenerateRequest] | None:
        if not await self.sock.poll(int(timeout_s * 1000)):
            return None
        identity, raw = await self.sock.recv_multipart()
        return identity, messages.decode(self.auth.open(raw))

    async def reply(self, identity: bytes, msg) -> None:
        await self.sock.send_multipart([identity, self.auth.seal(msg)])


class Harness:
    """A Router on this loop, a socket to report as workers, and fake workers."""

    def __init__(self, model_dir: str, stale_after_s: float = 30.0) -> None:
        self.router = Router(RouterConfig(model_dir=model_dir, http_port=0, zmq_port=0, max_model_len=512,
                                          stale_after_s=stale_after_s))
        self.router.start()
        self.ctx = zmq.asyncio.Context()
        self.report = self.ctx.socket(zmq.DEALER)
        self.report.setsockopt(zmq.LINGER, 0)
        self.report.connect(self.router.control_address)
        self.workers: list[FakeWorker] = []
        self.auth = Authenticator(self.router.key, "test harness")

    def worker(self, worker_id: str) -> FakeWorker:
        w = FakeWorker(self.ctx, worker_id, self.router.model_fingerprint, Authenticator(self.router.key, worker_id))
        self.workers.append(w)
        return w

    async def send(self, msg) -> None:
        await self.report.send(self.auth.seal(msg))

    async def send_raw(self, payload: bytes) -> None:
        """Signed, whatever the payload: a malformed message from inside the deployment."""
        await self.report.send(self.auth.signer.sign(payload))

    async def close(self) -> None:
        for w in self.workers:
            w.sock.close(0)
        self.report.close(0)
        self.ctx.term()
        await self.router.close()


async def collect(router: Router, sub: SubmitRequest) -> list:
    return [out async for out in router.generate(sub)]


def submit(rid: str, ids: list[int] = (5, 6, 7)) -> SubmitRequest:
    return SubmitRequest(rid, SamplingParams(temperature=0, max_tokens=2), prompt_token_ids=list(ids), return_timeline=True)


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def test_request_goes_to_the_worker_and_tokens_come_back(model_dirs):
    async def scenario():
        h = Harness(model_dirs["qwen3"])
        try:
            w = h.worker("c0")
            await h.send(w.hello())
            await h.router.wait_for_workers(0, 0, 1, timeout=5)
            job = asyncio.create_task(collect(h.router, submit("r1")))
            identity, req = await w.next_request()
            assert isinstance(req, GenerateRequest)
            assert (req.request_id, req.prompt_token_ids, req.prefill_addr) == ("r1", [5, 6, 7], "")
            assert req.return_timeline and list(req.timeline) == ["arrival", "routed"]
            text_ids = h.router.tokenizer.encode("hello world")
            await w.reply(identity, TokenOutput("r1", text_ids[:1]))
            await w.reply(identity, TokenOutput("r1", text_ids[1:], finished=True, finish_reason="length",
                                                timeline=dict(req.timeline, finish=req.timeline["routed"])))
            outs = await job
            # outputs already queued together are relayed as one message: compare the stream's content
            assert [t for o in outs for t in o.token_ids] == text_ids
            assert "".join(o.text for o in outs) == "hello world"
            assert outs[-1].finished and outs[-1].num_prompt_tokens == 3
            assert list(outs[-1].timeline) == ["arrival", "routed", "finish", "router_done"]
            assert h.router.inflight == {} and h.router.registry.workers["c0"].inflight == 0
        finally:
            await h.close()

    run(scenario())


def test_inflight_request_fails_when_its_worker_goes_silent(model_dirs):
    async def scenario():
        h = Harness(model_dirs["qwen3"], stale_after_s=0.4)
        try:
            w = h.worker("c0")
            await h.send(w.hello())
            await h.router.wait_for_workers(0, 0, 1, timeout=5)
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
            await new.reply(identity, TokenOutput("r1", [9], finished=True, finish_reason="length"))
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
