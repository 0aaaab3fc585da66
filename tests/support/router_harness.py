"""A Router on this event loop with fake workers made of bare ZeroMQ sockets (the router core and pool tests)."""
from __future__ import annotations

import asyncio
import zmq
import zmq.asyncio
from pdserve.common.clock import SYSTEM_CLOCK, Clock
from pdserve.common.wire import messages
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.messages import (GenerateRequest, RequestOutput, StepOutputs, SubmitRequest,
                                  WorkerHello)
from pdserve.common.wire.transport import Authenticator, bind_address
from pdserve.router.core.config import RouterConfig
from pdserve.router.core.router import Router


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

    def __init__(self, model_dir: str, stale_after_s: float = 30.0, clock: Clock = SYSTEM_CLOCK) -> None:
        self.router = Router(RouterConfig(model_dir=model_dir, http_port=0, zmq_port=0, max_model_len=512,
                                          stale_after_s=stale_after_s), clock=clock)
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

    async def registered(self, worker_id: str) -> FakeWorker:
        """A fake colocated worker that said hello and that the router has taken in."""
        w = self.worker(worker_id)
        await self.send(w.hello())
        await self.router.wait_for_workers(0, 0, 1, timeout=5)
        return w

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


def step(*entries: RequestOutput) -> StepOutputs:
    """A worker's message for one loop turn."""
    return StepOutputs(list(entries))


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def hello(wid: str, role: str = "prefill", address: str | None = None, total: int = 64) -> WorkerHello:
    return WorkerHello(worker_id=wid, role=role, address=address or f"tcp://127.0.0.1:{7000 + len(wid)}",
                       device="cpu", total_blocks=total, block_size=16, model_fingerprint="fp")
