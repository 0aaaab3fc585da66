"""The router: tokenizes, hashes the prompt's blocks, picks workers, forwards the request
to the decode (or colocated) worker and relays its token stream back to the caller,
making the text once (common/text/detokenizer.py) and ending a request at its stop string.
Runs on one asyncio loop shared with the ZeroMQ and HTTP front ends."""
from __future__ import annotations

import asyncio
import collections
import itertools
from concurrent.futures import ThreadPoolExecutor
import random
import sys
from typing import AsyncIterator, Callable

import zmq
import zmq.asyncio

from pdserve.common.clock import SYSTEM_CLOCK, Clock
from pdserve.common.wire.auth import DeploymentKey, new_secret
from pdserve.common.wire.curve import log_handshake_failures
from pdserve.common.engine.kv_layout import model_fingerprint
from pdserve.common.wire.messages import (AbortRequest, ErrorReply, GenerateRequest, RequestOutput,
                                  SubmitRequest, TokenOutput)
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.timeline import Stamp, mark
from pdserve.common.text.detokenizer import IncrementalDetokenizer
from pdserve.common.text.tokenizer import Tokenizer
from pdserve.common.wire.transport import Authenticator, bind_address
from pdserve.router.core.config import RouterConfig
from pdserve.router.core.disagg_state import Decision, Disaggregation
from pdserve.router.core.metrics import RouterMetrics
from pdserve.router.core.policy import choose_decode, choose_prefill, prefix_overlap
from pdserve.router.core.prompts import check_request, prepare, tokenize
from pdserve.router.core.recovery import attempt_id, resume_params, resume_prompt, retryable
from pdserve.router.core.registry import WorkerEntry, WorkerRegistry
from pdserve.router.core.requests import Choice, InFlight, Prepared, RouteError, drain_outputs, last_timeline
from pdserve.router.core.worker_links import WorkerLinks


ABORT_REPLY_WAIT_S = 2.0  # how long a stop-string finish waits for its worker's timeline (asked for only)
FINISHED_LOG = 4096  # finished requests the router remembers for the SLO planner (router/planner/loop.py)


class Router(WorkerLinks):
    """Owns the worker registry, the sockets to workers, the requests in flight, admission
    (how many may be prepared or in flight at once, `config.max_inflight`) and the
    deployment's secret: the control socket and the worker sockets accept only messages
    signed with it (common.wire.auth), CurveZMQ-encrypted when `curve`; `secret` "" makes
    a fresh one (single host)."""

    def __init__(self, config: RouterConfig, secret: str = "", clock: Clock = SYSTEM_CLOCK,
                 curve: bool = False) -> None:
        self.config = config
        self.clock = clock  # every timer and latency reading (a simulator hands its own)
        self.secret = secret or new_secret()
        self.key = DeploymentKey(self.secret, curve)
        self._control_auth = Authenticator(self.key, "router control socket")
        self._worker_auth = Authenticator(self.key, "router worker sockets")  # one signer for every worker
        self.tokenizer = Tokenizer(config.model_dir)
        self.model_fingerprint = model_fingerprint(config.model_dir, config.dtype, config.quantization)  # a worker must match it to register
        self.registry = WorkerRegistry(config.stale_after_s)
        self.metrics = RouterMetrics(config.model_name)
        self.rng = random.Random(config.seed)
        self.disagg = Disaggregation(config, self.metrics)  # per request: via a prefill worker or prefilled on D
        self._rr_prefill = itertools.count()  # one counter per choice, or with two workers
        self._rr_decode = itertools.count()   # per role each would only ever see even indices
        self.ctx = zmq.asyncio.Context()
        self.control = self.ctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.key.curve_server(self.control)
        self.control_address = bind_address(self.control, config.control_address())
        self.worker_socks: dict[str, zmq.asyncio.Socket] = {}
        self._worker_addr: dict[str, str] = {}
        self._worker_tasks: dict[str, asyncio.Task] = {}
        self.inflight: dict[str, InFlight] = {}
        # finished requests, newest last: (monotonic s, TTFT s, TPOT s or None, sent at, prompt
        # tokens, output tokens of the longest choice); the SLO planner's window
        self.finished_log: collections.deque = collections.deque(maxlen=FINISHED_LOG)
        self.preparing = 0  # admitted requests being tokenized (in the pool), not yet in flight
        # tokenizers releases the GIL while encoding: the event loop keeps serving meanwhile
        self._pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        self._by_wire: dict[str, InFlight] = {}  # attempt id -> request (router/core/recovery.py)
        self._tasks: list[asyncio.Task] = []
        self.control_api: Callable[[bytes, object], None] | None = None  # router/pools/control.py: pool requests
        self.failed: dict[str, tuple[str, str]] = {}  # worker id -> (role, why): its launcher gave up starting it

    # ---- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._control_loop()))
        self._tasks.append(asyncio.create_task(self._expire_loop()))
        # a worker without the secret (or with the other --curve) fails the handshake: no message says so
        self._tasks.append(asyncio.create_task(log_handshake_failures(self.control, "router control socket")))

    async def close(self) -> None:
        for t in [*self._tasks, *self._worker_tasks.values()]:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # the handshake log closes its monitor socket
        for sock in self.worker_socks.values():
            sock.close(0)
        self.control.close(0)
        self.ctx.term()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- requests -----------------------------------------------------------------------
    @property
    def busy(self) -> int:
        """Requests being prepared (tokenized) or in flight."""
        return len(self.inflight) + self.preparing

    def admit(self) -> None:
        """RouteError "overloaded" when `max_inflight` requests are already being prepared
        or in flight; the caller answers it at once (HTTP 429 + Retry-After)."""
        busy = self.busy
        if busy >= self.config.max_inflight:
            self.metrics.request_done("overloaded")
            wait = self.config.retry_after_s
            raise RouteError(f"server overloaded: {busy} requests in flight (limit {self.config.max_inflight}); "
                             f"retry after {wait} s", "overloaded", wait)

    def prepare(self, sub: SubmitRequest) -> Prepared:
        """Validate and tokenize once, at the edge (router/core/prompts.py); RouteError names what
        is wrong. Blocks for as long as tokenizing takes: the serving path calls `prepare_async`."""
        return prepare(sub, self.tokenizer, self.config, self.clock.time())

    async def prepare_async(self, sub: SubmitRequest) -> Prepared:
        """Admission, the cheap checks on the loop, then template + tokens + hashes in the
        tokenizer pool; the request counts against `max_inflight` from here."""
        self.admit()
        check_request(sub, self.tokenizer.vocab_size, self.config)  # refuse a 15 MB prompt before it costs a thread
        self.preparing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self.prepare, sub)
        finally:
            self.preparing -= 1

    async def tokenize_async(self, sub: SubmitRequest) -> list[int]:
        """The prompt ids `prepare` would make for `sub` (in the tokenizer pool), without
        admitting or routing anything; RouteError names what is wrong. For /tokenize."""
        check_request(sub, self.tokenizer.vocab_size, self.config)
        return await asyncio.get_running_loop().run_in_executor(self._pool, tokenize, self.tokenizer, sub)

    def route(self, prep: Prepared, avoid: frozenset[str] = frozenset()
              ) -> tuple[WorkerEntry, WorkerEntry | None, Decision | None, int]:
        """(decode-or-colocated worker, prefill worker or None, a P + D pair's disaggregation
        decision, the prompt blocks the worker computing it lacks); workers in `avoid`
        (that just failed this request) only when no other is live."""
        reg, policy = self.registry, self.config.routing
        hashes = prep.block_hashes[:(len(prep.token_ids) - 1) // self.config.block_size]  # what a cache can match
        prefills, decodes = reg.live_except("prefill", avoid), reg.live_except("decode", avoid)
        if prefills and decodes:
            queued = self._queued_blocks()
            prefill = reg.workers[choose_prefill(reg.views(prefills, hashes, queued), policy, self.rng,
                                                 next(self._rr_prefill))]
            decode = reg.workers[choose_decode(reg.views(decodes), policy, self.rng, next(self._rr_decode))]
            choice = self.disagg.decide(len(prep.token_ids), hashes, decode, prefill, self.inflight.values())
            blocks = self._note_routed(prefill if choice.disaggregate else decode, hashes, len(prep.token_ids))
            return decode, prefill if choice.disaggregate else None, choice, blocks
        colocated = reg.live_except("colocated", avoid)
        if colocated:
            views = reg.views(colocated, hashes, self._queued_blocks())
            c_id = choose_prefill(views, policy, self.rng, next(self._rr_prefill))
            return reg.workers[c_id], None, None, self._note_routed(reg.workers[c_id], hashes, len(prep.token_ids))
        raise RouteError("no live worker can serve this request (prefill+decode or colocated)", "unavailable")

    def _note_routed(self, entry: WorkerEntry, hashes: list[int], num_tokens: int) -> int:
        """Count the routing hit and return the prompt blocks `entry` lacks (past its cached
        prefix); then assume it will cache this prompt's blocks: the next request with the
        same prefix should follow it before the worker's heartbeat confirms (evictions
        still arrive as events)."""
        self.metrics.routed_prefix(hashes, entry.cached)
        blocks = -(-num_tokens // self.config.block_size) - prefix_overlap(hashes, entry.cached)
        entry.cached.update(hashes)
        return blocks

    def _queued_blocks(self) -> dict[str, int]:
        """Worker id -> prompt blocks it has been sent to compute and has not yet (requests
        in flight without a first token), read from the requests themselves: no count to
        keep in step with every way a request ends."""
        queued: dict[str, int] = {}
        for r in self.inflight.values():
            if r.first_token_at is None:
                wid = (r.prefill or r.decode).worker_id
                queued[wid] = queued.get(wid, 0) + r.prompt_blocks
        return queued

    async def generate(self, request: SubmitRequest | Prepared) -> AsyncIterator[TokenOutput | ErrorReply]:
        """Route one request and yield its outputs (text deltas filled), each for choice
        `index` of the request's n; each choice's last has finished=True, or the last
        output is an ErrorReply. Cancelling the iterator aborts the request.
        A SubmitRequest is prepared here; the HTTP front end prepares before it answers."""
        try:
            prep = request if isinstance(request, Prepared) else await self.prepare_async(request)
            decode, prefill, choice, blocks = self.route(prep)
        except RouteError as e:
            if e.code != "overloaded":  # admit() counted that one
                self.metrics.request_done("error")
            yield ErrorReply(request.request_id if isinstance(request, SubmitRequest) else request.sub.request_id,
                             str(e), e.code)
            return
        sub = prep.sub
        if sub.request_id in self.inflight:
            yield ErrorReply(sub.request_id, f"request id {sub.request_id!r} is already in flight")
            return
        choices = [Choice(IncrementalDetokenizer.for_request(self.tokenizer, prep.params)) for _ in range(prep.params.n)]
        req = InFlight(sub.request_id, asyncio.Queue(), decode, prefill, choices, len(prep.token_ids),
                       self.clock.monotonic(), wire_id=sub.request_id, route=choice, prompt_blocks=blocks)
        self.inflight[req.request_id] = req
        self._by_wire[req.wire_id] = req
        self._take_load(req)
        finished = False
        try:
            await self._send_attempt(req, prep, prep.token_ids, prep.block_hashes, prep.params)
            while not finished:
                for out in drain_outputs(req.queue, await req.queue.get()):
                    if out.request_id != req.wire_id:
                        continue  # a late reply to an earlier attempt
                    if isinstance(out, ErrorReply):
                        # n > 1 resumes nothing: its choices retry only before any was streamed
                        if retryable(out, req.attempts, self.config.retries) and (len(choices) == 1 or not req.streamed):
                            try:
                                await self._retry(req, prep, out)
                                continue
                            except RouteError as e:
                                out = ErrorReply(req.request_id, f"{out.message}; no worker to retry on: {e}", out.code)
                        finished = True
                        self.metrics.request_done("error")
                        out.request_id = req.request_id
                        yield out
                        return
                    if not 0 <= out.index < len(choices) or choices[out.index].finished:
                        continue  # a choice a stop string ended here: the worker's last entries for it
                    reply = self._relay(req, choices[out.index], out)
                    finished = all(c.finished for c in choices)
                    if reply.finished and not out.finished:  # a stop string: the worker is still decoding it
                        await self._abort_attempt(req, -1 if finished else out.index)
                        if finished and sub.return_timeline and len(choices) == 1:  # with its answer to the abort
                            reply.timeline = await last_timeline(req, self.clock, ABORT_REPLY_WAIT_S)
                    if reply.finished:
                        reply.num_prompt_tokens = len(prep.token_ids)
                        if reply.timeline is not None:
                            mark(reply.timeline, Stamp.ROUTER_DONE, self.clock.time())
                    yield reply
                    if finished:
                        break
        finally:
            self._release(req)
            if not finished:  # the caller went away: stop the work
                self.metrics.request_done("aborted")
                await self._abort_attempt(req)

    async def _abort_attempt(self, req: InFlight, index: int = -1) -> None:
        """Tell the current attempt's worker to stop and free the request (its replies
        from now on find no request here and are dropped), or, `index` >= 0, that choice."""
        sock = self.worker_socks.get(req.decode.worker_id)
        if sock is not None:
            await sock.send_multipart([self._worker_auth.seal(AbortRequest(req.wire_id, index))])

    async def _send_attempt(self, req: InFlight, prep: Prepared, ids: list[int], hashes: list[int],
                            params: SamplingParams) -> None:
        timeline: dict[str, float] = {}
        mark(timeline, Stamp.ARRIVAL, prep.arrival)
        mark(timeline, Stamp.ROUTED, now := self.clock.time())
        self.disagg.mark(timeline, req.route, now)
        prefill = req.prefill
        msg = GenerateRequest(req.wire_id, ids, params, prefill.hello.address if prefill else "",
                              prep.sub.return_timeline, timeline, hashes)
        await self.worker_socks[req.decode.worker_id].send_multipart([self._worker_auth.seal(msg)])

    async def _retry(self, req: InFlight, prep: Prepared, err: ErrorReply) -> None:
        """Route the request again after `err` (router/core/recovery.py): re-prefill if nothing
        was streamed, else resume from prompt + streamed tokens. RouteError: no worker."""
        failed = {req.decode.worker_id}
        if req.prefill is not None and req.decode.alive:  # D reported it: its prefill worker or transfer failed
            failed = {req.prefill.worker_id}
        old_wire, old_decode = req.wire_id, req.decode
        streamed = req.choices[0].output_ids if len(req.choices) == 1 else []  # n > 1 retries only unstreamed
        ids, hashes = resume_prompt(prep.token_ids, streamed, self.config.block_size)
        params = resume_params(prep.params, len(streamed))
        decode, prefill, req.route, req.prompt_blocks = self.route(Prepared(prep.sub, ids, params, hashes, prep.arrival),
                                                                   frozenset(failed))
        self._give_load(req)
        req.attempts += 1
        req.decode, req.prefill, req.prefill_released = decode, prefill, False
        self._by_wire.pop(old_wire, None)
        req.wire_id = attempt_id(req.request_id, req.attempts)
        self._by_wire[req.wire_id] = req
        self._take_load(req)
        kind = "resume" if streamed else "reprefill"
        self.metrics.recoveries.labels(kind).inc()
        print(f"router: request {req.request_id}: {err.code} ({err.message}); {kind} on {decode.worker_id}"
              f"{' via ' + prefill.worker_id if prefill else ''} (attempt {req.attempts + 1})",
              file=sys.stderr, flush=True)
        if old_decode.alive and (sock := self.worker_socks.get(old_decode.worker_id)):
            await sock.send_multipart([self._worker_auth.seal(AbortRequest(old_wire))])  # whatever it still holds
        await self._send_attempt(req, prep, ids, hashes, params)

    def _take_load(self, req: InFlight) -> None:
        req.decode.take()
        if req.prefill is not None and not req.prefill_released:
            req.prefill.take()

    def _give_load(self, req: InFlight) -> None:
        req.decode.inflight -= 1
        self._release_prefill(req)

    def _relay(self, req: InFlight, choice: Choice, out: RequestOutput) -> TokenOutput:
        """The client's message for a worker's entry: its text delta, and the end of the
        choice where a stop string completed (its tokens up to and including the one that
        completed it, finish_reason "stop"; later tokens are dropped)."""
        if out.num_prompt_tokens:
            req.num_cached_tokens = out.num_cached_tokens
        before = len(choice.detok.token_ids)
        text = choice.detok.add(out.token_ids, out.finished)
        ids, finished, reason = out.token_ids, out.finished, out.finish_reason
        if choice.detok.stopped:
            ids, finished, reason = ids[:len(choice.detok.token_ids) - before], True, "stop"
        # the counts go to the client on its last message only (docs/protocol.md)
        reply = TokenOutput(req.request_id, ids, text, finished, reason, 0, req.num_cached_tokens if finished else 0,
                            out.timeline, out.logprobs[:len(ids)] if out.logprobs is not None else None, out.index,
                            prompt_logprobs=out.prompt_logprobs)
        choice.output_ids += ids
        choice.finished = finished
        self._account(req, reply)
        return reply

    def _account(self, req: InFlight, out: TokenOutput) -> None:
        now = self.clock.monotonic()
        if out.token_ids and req.first_token_at is None:
            req.first_token_at = now
            self._release_prefill(req)  # its prefill phase is over
            self.metrics.ttft(now - req.sent_at)
        req.num_output_tokens += len(out.token_ids)
        if all(c.finished for c in req.choices):  # n > 1: TPOT of the longest choice
            self.metrics.request_done(out.finish_reason or "stop")
            self.metrics.e2e(now - req.sent_at)
            longest = max(len(c.output_ids) for c in req.choices)
            tpot = None
            if longest > 1 and req.first_token_at is not None:
                tpot = (now - req.first_token_at) / (longest - 1)
                self.metrics.tpot(tpot)
            if req.first_token_at is not None:
                self.finished_log.append((now, req.first_token_at - req.sent_at, tpot, req.sent_at,
                                          req.num_prompt_tokens, longest))
            self.metrics.tokens(req.num_prompt_tokens, req.num_output_tokens)

    def _release_prefill(self, req: InFlight) -> None:
        if req.prefill is not None and not req.prefill_released:
            req.prefill_released = True
            req.prefill.inflight -= 1

    def _release(self, req: InFlight) -> None:
        """The one place a request's load on its workers is given back (once)."""
        if self.inflight.pop(req.request_id, None) is None:
            return
        self._by_wire.pop(req.wire_id, None)
        self._give_load(req)

