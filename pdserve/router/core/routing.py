"""The router's choice of workers for a request: among the routable workers
(router/core/availability.py), a prefill + decode pair, a colocated worker, or -- with no
prefill worker left -- a decode worker that prefills the prompt itself (degraded); and
where nothing can serve, the request held for a worker up to `worker_wait_s`
(router/core/hold.py). The choices themselves are pure functions (router/core/policy.py,
router/core/disagg_policy.py); this module feeds them the router's state.

`Routing` is a part of `Router` (router/core/router.py), which owns the state it reads:
the registry, the requests in flight, the disaggregation policy, the metrics, the rng,
the round-robin counters, the clock and the held requests (`waits`)."""
from __future__ import annotations

import sys

from pdserve.router.core.availability import (COLOCATED, DECODE_LOCAL, NONE, OK, PREFILL_DECODE, hold_left_s,
                                              plan, serving_state)
from pdserve.router.core.disagg_state import Decision
from pdserve.router.core.policy import choose_decode, choose_prefill, prefix_overlap
from pdserve.router.core.registry import WorkerEntry
from pdserve.router.core.requests import Prepared, RouteError

Route = tuple[WorkerEntry, WorkerEntry | None, Decision | None, int]  # what `Routing.route` chose
NO_PREFILL = "no_prefill"  # the reason of a prompt prefilled on its decode worker for want of a prefill worker


class Routing:
    """Choosing a request's workers, and holding it where none can serve. Mixed into
    `Router`, whose constructor makes every attribute used here."""

    _last_state: str = OK  # the serving state the last request routed found (logged when it changes)

    def route(self, prep: Prepared, avoid: frozenset[str] = frozenset()) -> Route:
        """(decode-or-colocated worker, prefill worker or None, a P + D pair's disaggregation
        decision, the prompt blocks the worker computing it lacks), among the routable
        workers (router/core/availability.py: serving, not suspected, not at an address in
        `avoid` -- those failed this request). With decode workers and no prefill worker,
        the decode worker prefills the prompt itself (degraded, counted). RouteError
        "unavailable" when nothing can serve it."""
        reg, policy = self.registry, self.config.routing
        hashes = prep.block_hashes[:(len(prep.token_ids) - 1) // self.config.block_size]  # what a cache can match
        now = self.clock.monotonic()
        cands = reg.routable(now, avoid)
        how = plan(cands)
        self._note_plan(plan(reg.routable(now)) if avoid else how)  # the deployment's state, not this request's
        if how == PREFILL_DECODE:
            queued = self._queued_blocks()
            prefill = reg.workers[choose_prefill(reg.views(cands["prefill"], hashes, queued), policy, self.rng,
                                                 next(self._rr_prefill))]
            decode = reg.workers[choose_decode(reg.views(cands["decode"]), policy, self.rng, next(self._rr_decode))]
            choice = self.disagg.decide(len(prep.token_ids), hashes, decode, prefill, self.inflight.values())
            blocks = self._note_routed(prefill if choice.disaggregate else decode, hashes, len(prep.token_ids))
            return decode, prefill if choice.disaggregate else None, choice, blocks
        if how in (COLOCATED, DECODE_LOCAL):  # the worker computes the prompt: chosen as a prefill worker is
            pool = cands["colocated" if how == COLOCATED else "decode"]
            views = reg.views(pool, hashes, self._queued_blocks())
            worker = reg.workers[choose_prefill(views, policy, self.rng, next(self._rr_prefill))]
            choice = None
            if how == DECODE_LOCAL:
                lacks = len(prep.token_ids) - prefix_overlap(hashes, worker.cached) * self.config.block_size
                choice = Decision(False, NO_PREFILL, lacks)
                self.metrics.degraded_requests.labels(NO_PREFILL).inc()
                self.metrics.disagg_decisions.labels(choice.label, NO_PREFILL).inc()
            return worker, None, choice, self._note_routed(worker, hashes, len(prep.token_ids))
        assert how == NONE
        raise RouteError("no live worker can serve this request (prefill+decode, decode or colocated)",
                         "unavailable", self.config.retry_after_s)

    def _note_plan(self, how: str) -> None:
        """Log the deployment entering or leaving a degraded mode (as a request finds it)."""
        state = serving_state(how)
        if state != self._last_state:
            why = {DECODE_LOCAL: ": no live prefill worker, the decode workers prefill every prompt",
                   NONE: ": no live worker can serve a request; requests wait for one"}.get(how, "")
            print(f"router: serving {state}{why}", file=sys.stderr, flush=True)
            self._last_state = state

    async def _route_held(self, prep: Prepared, avoid: frozenset[str], since: float) -> Route:
        """`route`, and where nothing can serve the request, wait for a worker to register or
        be heard again for what is left of `config.worker_wait_s` since `since` (wall-clock
        s, the router's clock); then RouteError "unavailable" with Retry-After."""
        held = False
        while True:
            try:
                found = self.route(prep, avoid)
            except RouteError as e:
                if e.code != "unavailable":
                    raise
                left = hold_left_s(since, self.clock.time(), self.config.worker_wait_s)
                if left <= 0:
                    waited = f"; none registered within {self.config.worker_wait_s:g} s" if held else ""
                    raise RouteError(f"{e}{waited}; retry after {e.retry_after_s} s", e.code, e.retry_after_s) \
                        from None
                held = True
                await self.waits.wait(left)
                continue
            if held:
                self.metrics.degraded_requests.labels("held").inc()
            return found

    async def servable(self, prep: Prepared) -> None:
        """Return once some worker can serve `prep`, waiting for one as `generate` would
        (the same deadline, counted from its arrival); RouteError "unavailable" (with
        Retry-After) if none comes. The HTTP front end calls it before a stream's 200, so a
        stream nothing can serve gets a 503, not a 200 and an error event."""
        while plan(self.registry.routable(self.clock.monotonic())) == NONE:
            left = hold_left_s(prep.arrival, self.clock.time(), self.config.worker_wait_s)
            if left <= 0:
                wait = self.config.retry_after_s
                self.metrics.request_done("error")
                raise RouteError(f"no live worker can serve this request; none registered within "
                                 f"{self.config.worker_wait_s:g} s; retry after {wait} s", "unavailable", wait)
            await self.waits.wait(left)

    def serving_state(self) -> str:
        """ok, degraded or unavailable (router/core/availability.py), as routing sees the pools now."""
        return serving_state(plan(self.registry.routable(self.clock.monotonic())))

    def suspected(self) -> list[WorkerEntry]:
        """Serving workers that get no new request now (silent, or their connection failed)."""
        return self.registry.suspected(self.clock.monotonic())

    def observe_pools(self) -> None:
        """The pool gauges of /metrics as they are now: workers by role and state, the
        serving state, the requests held for a worker."""
        self.metrics.pools(self.registry.pool_counts())
        self.metrics.serving_state(self.serving_state())
        self.metrics.held.set(self.waits.held)

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
