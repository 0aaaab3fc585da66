"""What the router knows of one request: the form it is prepared into at the edge
(`Prepared`), its relay state while in flight (`InFlight`), why it cannot be routed
(`RouteError`), and how queued worker outputs are merged for the relay (`drain_outputs`)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pdserve.common.clock import Clock
from pdserve.common.wire.messages import ErrorReply, RequestOutput, SubmitRequest
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.text.detokenizer import IncrementalDetokenizer
from pdserve.router.core.disagg_policy import Decision
from pdserve.router.core.registry import WorkerEntry


class RouteError(ValueError):
    """A request cannot be routed as given (bad input, or no live worker)."""

    def __init__(self, message: str, code: str = "bad_request", retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s  # set with code "overloaded"


@dataclass
class Prepared:
    """A client request made ready once, at the edge: its token ids, checked sampling
    parameters and the chained hashes of its full blocks (what routing and every worker's
    prefix cache use)."""

    sub: SubmitRequest
    token_ids: list[int]
    params: SamplingParams
    block_hashes: list[int]
    arrival: float  # wall-clock seconds (the router's clock) it was received


@dataclass
class Choice:
    """One choice's relay state (a request has `n`): its detokenizer -- the text and the
    stop strings belong to the client request, not to an attempt -- the tokens the caller
    has been sent, and whether it has ended."""

    detok: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False


@dataclass
class InFlight:
    """One client request the router is relaying, across its attempts (router/core/recovery.py):
its workers, its queue of worker outputs, and its choices (`SamplingParams.n`)."""

    request_id: str
    queue: asyncio.Queue
    decode: WorkerEntry
    prefill: WorkerEntry | None
    choices: list[Choice]
    num_prompt_tokens: int
    sent_at: float
    timeline: dict[str, float] = field(default_factory=dict)
    first_token_at: float | None = None
    num_output_tokens: int = 0
    prompt_blocks: int = 0  # blocks of its prompt the worker computing it (P, else D) lacks: its queue until the first token
    prefill_released: bool = False  # its prefill worker's share of load was given back
    wire_id: str = ""  # the id the current attempt travels under (router/core/recovery.py)
    attempts: int = 0  # attempts after the first (re-routed after a worker failed)
    num_cached_tokens: int = 0  # the current attempt's, from its first output
    route: Decision | None = None  # the current attempt's disaggregation decision (P + D pairs)

    @property
    def streamed(self) -> int:
        """Tokens the caller has been sent, every choice together."""
        return sum(len(c.output_ids) for c in self.choices)


def drain_outputs(queue: asyncio.Queue, first: RequestOutput | ErrorReply) -> list[RequestOutput | ErrorReply]:
    """`first` and every output already queued behind it, consecutive entries of one
    attempt merged into one: under load the relay sends one message (one SSE chunk) per
    wake-up instead of one per worker step, so it keeps up with the decode worker. Order
    and content are kept."""
    outs = [first]
    while not queue.empty():
        nxt = queue.get_nowait()
        last = outs[-1]
        if isinstance(nxt, RequestOutput) and isinstance(last, RequestOutput) and not last.finished \
                and nxt.request_id == last.request_id and nxt.index == last.index:  # never across attempts or choices
            last.token_ids = [*last.token_ids, *nxt.token_ids]
            if nxt.logprobs:  # one per token when the request asks
                last.logprobs = [*(last.logprobs or ()), *nxt.logprobs]
            last.finished, last.finish_reason = nxt.finished, nxt.finish_reason
            if nxt.num_prompt_tokens:  # counts ride on an attempt's first and last entries only
                last.num_prompt_tokens, last.num_cached_tokens = nxt.num_prompt_tokens, nxt.num_cached_tokens
            last.timeline = nxt.timeline
            if nxt.prompt_logprobs is not None:  # an attempt's first entry carries them
                last.prompt_logprobs = nxt.prompt_logprobs
        else:
            outs.append(nxt)
    return outs


async def last_timeline(req: InFlight, clock: Clock, wait_s: float) -> dict[str, float] | None:
    """The timeline of the current attempt's last entry (its worker answers an abort with
    one), waited for at most `wait_s` of `clock`; None if none comes. Only a request that
    asked for its timeline waits."""
    deadline = clock.monotonic() + wait_s
    while (left := deadline - clock.monotonic()) > 0:
        get = asyncio.ensure_future(req.queue.get())
        timer = asyncio.ensure_future(clock.sleep_async(left))
        done, _ = await asyncio.wait({get, timer}, return_when=asyncio.FIRST_COMPLETED)
        timer.cancel()
        if get not in done:
            get.cancel()
            return None
        out = get.result()
        if out.request_id == req.wire_id and (isinstance(out, ErrorReply) or out.finished):
            return None if isinstance(out, ErrorReply) else out.timeline
    return None
