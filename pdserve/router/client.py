"""Python clients for the router's ZeroMQ front end: `Client` (blocking) and
`AsyncClient` (asyncio), each with a one-shot `generate` and a streaming iterator.

    with Client("tcp://127.0.0.1:5555") as c:
        print(c.generate("Hello", max_tokens=16, temperature=0).text)
        for out in c.stream("Hello", max_tokens=16):
            print(out.text, end="", flush=True)
        c.generate(messages=[...], chat_template_kwargs={"enable_thinking": False})

Keyword arguments are sampling parameters (common/sampling_params.py), except the prompt
options of `SubmitRequest` (`PROMPT_OPTIONS`: add_special_tokens, add_generation_prompt,
continue_final_message, chat_template_kwargs, tools; docs/protocol.md). The text comes as
the model wrote it: `router.tool_parsers.parse_tool_calls` and
`router.reasoning.split_reasoning` read tool calls and reasoning out of it. With `n` > 1
the stream interleaves the choices (`TokenOutput.index`) and ends when each has finished;
`choices(...)` returns every choice's Completion, `generate` refuses n > 1.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

import zmq
import zmq.asyncio

from pdserve.common.wire import messages as wire
from pdserve.common.wire.curve import connect_to
from pdserve.common.logprobs import TokenLogprobs
from pdserve.common.wire.messages import AbortRequest, ClientHeartbeat, ErrorReply, SubmitRequest, TokenOutput
from pdserve.common.sampling_params import SamplingParams
from pdserve.router.core.text import merge_outputs


class ServerError(RuntimeError):
    """The server answered with an error (bad request, no worker, aborted...)."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(reply.message)
        self.code = reply.code
        self.request_id = reply.request_id


@dataclass
class Completion:
    """A finished request."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    timeline: dict[str, float] | None = None
    token_times: list[float] = field(default_factory=list)  # client clock, one per token
    logprobs: list[TokenLogprobs] | None = None  # one per token, when asked (`logprobs=n`)
    index: int = 0  # the choice, of the request's n
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token, when asked (`prompt_logprobs=n`)


PROMPT_OPTIONS = ("add_special_tokens", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                  "tools")


def _submit(prompt: str | list[int] | None, messages_: list[dict[str, str]] | None, stream: bool,
            return_timeline: bool, kwargs: dict[str, Any]) -> SubmitRequest:
    """The request; `kwargs` are the prompt options (PROMPT_OPTIONS) and sampling parameters."""
    text = prompt if isinstance(prompt, str) else None
    ids = prompt if isinstance(prompt, list) else None
    options = {k: v for k, v in kwargs.items() if k in PROMPT_OPTIONS}
    sampling = {k: v for k, v in kwargs.items() if k not in PROMPT_OPTIONS}
    return SubmitRequest(request_id=uuid.uuid4().hex, sampling=SamplingParams.unchecked(**sampling), prompt=text,
                         prompt_token_ids=ids, messages=messages_, stream=stream, return_timeline=return_timeline,
                         **options)


def _merge(request_id: str, outs: list[TokenOutput], times: list[float]) -> Completion:
    res = merge_outputs(outs)
    return Completion(request_id, res.text, res.token_ids, res.finish_reason, res.num_prompt_tokens,
                      res.num_cached_tokens, res.timeline, times, res.logprobs, res.index,
                      res.prompt_logprobs)


def _choices(outs: list[TokenOutput], times: list[float]) -> list[Completion]:
    """Each choice's Completion, by index, from a request's interleaved outputs (`times`: one per token)."""
    per: dict[int, tuple[list[TokenOutput], list[float]]] = {}
    at = 0
    for out in outs:
        o, t = per.setdefault(out.index, ([], []))
        o.append(out)
        t += times[at:at + len(out.token_ids)]
        at += len(out.token_ids)
    return [_merge(o[-1].request_id, o, t) for _, (o, t) in sorted(per.items())]


def _one_choice(kwargs: dict[str, Any]) -> None:
    if kwargs.get("n", 1) != 1:
        raise ValueError("n > 1 gives n completions: call choices() instead of generate()")


def _socket(ctx: zmq.Context, address: str, server_key: str | None) -> zmq.Socket:
    """A DEALER connected to the router; a CurveZMQ client of it when `server_key` (the Z85
    public key `pdserve serve --zmq-curve` prints) is given."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key:
        connect_to(sock, server_key.encode())
    sock.connect(address)
    return sock


HEARTBEAT_S = 2.0  # while a request is in flight (docs/protocol.md); well under the router's client timeout


class Client:
    """Blocking client; one DEALER socket, requests served one at a time. While it waits
    for a reply it heartbeats, so the router can tell it from a client that went away."""

    def __init__(self, address: str, timeout_s: float = 600.0, server_key: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = _socket(self.ctx, address, server_key)
        self.timeout_ms = int(timeout_s * 1000)

    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict[str, str]] | None = None,
               return_timeline: bool = False, **kwargs: Any) -> Iterator[TokenOutput]:
        """Yield TokenOutput messages as tokens arrive; raises ServerError on an error reply.
        `kwargs`: sampling parameters and prompt options (the module's docstring)."""
        sub = _submit(prompt, messages, True, return_timeline, kwargs)
        self.sock.send(wire.encode(ClientHeartbeat(HEARTBEAT_S)))
        self.sock.send(wire.encode(sub))
        finished, left = False, sub.sampling.n  # choices not finished yet
        try:
            while not finished:
                if not self._wait(sub.request_id):
                    raise TimeoutError(f"no reply for request {sub.request_id} in {self.timeout_ms} ms")
                msg = wire.decode(self.sock.recv())
                if getattr(msg, "request_id", None) not in (sub.request_id, ""):
                    continue  # a late reply to an earlier, abandoned request
                if isinstance(msg, ErrorReply):
                    finished = True
                    raise ServerError(msg)
                left -= msg.finished
                finished = left == 0
                yield msg
        finally:
            if not finished:
                self.sock.send(wire.encode(AbortRequest(sub.request_id)))

    def _wait(self, request_id: str) -> bool:
        """Poll for a reply up to the timeout, heartbeating meanwhile."""
        waited = 0
        step = int(HEARTBEAT_S * 1000)
        while waited < self.timeout_ms:
            if self.sock.poll(min(step, self.timeout_ms - waited)):
                return True
            waited += step
            self.sock.send(wire.encode(ClientHeartbeat(HEARTBEAT_S)))
        return False

    def generate(self, prompt: str | list[int] | None = None, **kwargs: Any) -> Completion:
        _one_choice(kwargs)
        return self.choices(prompt, **kwargs)[0]

    def choices(self, prompt: str | list[int] | None = None, **kwargs: Any) -> list[Completion]:
        """Every choice (`n` of them) of one request, by index."""
        import time
        outs, times = [], []
        for out in self.stream(prompt, **kwargs):
            outs.append(out)
            times += [time.perf_counter()] * len(out.token_ids)
        return _choices(outs, times)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client; many requests in flight over one socket, demultiplexed by id."""

    def __init__(self, address: str, server_key: str | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = _socket(self.ctx, address, server_key)
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._heartbeat: asyncio.Task | None = None

    async def _beat(self) -> None:
        """Heartbeat while any request is in flight (docs/protocol.md)."""
        while True:
            if self._queues:
                await self.sock.send(wire.encode(ClientHeartbeat(HEARTBEAT_S)))
            await asyncio.sleep(HEARTBEAT_S)

    async def _read(self) -> None:
        while True:
            msg = wire.decode(await self.sock.recv())
            q = self._queues.get(getattr(msg, "request_id", ""))
            if q is not None:
                q.put_nowait(msg)

    async def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict[str, str]] | None = None,
                     return_timeline: bool = False, **kwargs: Any) -> AsyncIterator[TokenOutput]:
        """As Client.stream, many at once over one socket."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
            self._heartbeat = asyncio.create_task(self._beat())
        sub = _submit(prompt, messages, True, return_timeline, kwargs)
        q = self._queues[sub.request_id] = asyncio.Queue()
        finished, left = False, sub.sampling.n  # choices not finished yet
        try:
            await self.sock.send(wire.encode(sub))
            while not finished:
                msg = await q.get()
                if isinstance(msg, ErrorReply):
                    finished = True
                    raise ServerError(msg)
                left -= msg.finished
                finished = left == 0
                yield msg
        finally:
            self._queues.pop(sub.request_id, None)
            if not finished:
                await self.sock.send(wire.encode(AbortRequest(sub.request_id)))

    async def generate(self, prompt: str | list[int] | None = None, **kwargs: Any) -> Completion:
        _one_choice(kwargs)
        return (await self.choices(prompt, **kwargs))[0]

    async def choices(self, prompt: str | list[int] | None = None, **kwargs: Any) -> list[Completion]:
        """As Client.choices."""
        import time
        outs, times = [], []
        async for out in self.stream(prompt, **kwargs):
            outs.append(out)
            times += [time.perf_counter()] * len(out.token_ids)
        return _choices(outs, times)

    async def close(self) -> None:
        for t in (self._reader, self._heartbeat):
            if t is not None:
                t.cancel()
        self.sock.close(0)
        self.ctx.term()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
