"""The SLO planner in the router process: every `interval_s` it reads a `Snapshot` of
the router (the requests that finished in the window, the pools' queues and KV use),
judging attainment on at least `cfg.min_requests` requests where the window holds fewer (the
latest before it, sent since the pools last changed: at a low rate a 5 s window holds one
request or none, 0% or 100%) and the load of the last `LOAD_S` (what the rule's memory of a
layout is kept with), asks the rule (router/planner/rule.py) for a plan, applies it through the pool control API
(router/pools/control.py), logs it with its figures and exports them as metrics.

A split or merge (one host, docs/slo.md "Planner") starts the new workers first and
drains the old ones only once every new one serves: a deployment never drops to no
worker able to serve, as the control API's last-worker rule demands."""
from __future__ import annotations

import asyncio
import collections
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.common.clock import Clock
from pdserve.router.pools.control import ControlPlane
from pdserve.router.planner.rule import ADD, MERGE, NONE, REROLE, SPLIT, Load, Plan, PlannerConfig, PlannerState, Pools, \
    Snapshot, decide, score, share
from pdserve.router.planner.predict import PREDICT_S, REFRESH_S, Predictor
from pdserve.router.core.registry import SERVING, PoolError
from pdserve.router.core.background import Background

CHANGING = ("starting", "draining", "exiting")
LOAD_S = 120.0  # the load is that of the requests sent in the last LOAD_S that have finished
LOAD_MIN = 4    # ... at least this many of them, else it is not known
CPU_MIN_TOKENS = 200  # the router's CPU a token is priced over at least this many streamed tokens, else not
IDLE_SAMPLES = 8      # the router's idle CPU rate: the median of its last this many idle windows


@dataclass
class Swap:
    """A split or merge under way: the new workers, and the old ones drained once they all serve."""

    new: list[str]
    old: list[str]
    started_at: float


@dataclass
class PlannerMetrics:
    """The planner's series, in the router's registry."""

    decisions: Counter
    gauges: dict[str, Gauge] = field(default_factory=dict)

    @classmethod
    def create(cls, registry: CollectorRegistry) -> PlannerMetrics:
        decisions = Counter("pdserve_planner_decisions", "SLO planner decisions, one per window, by action "
                            "(none, add, re_role, split, merge) and reason", ["action", "reason"], registry=registry)
        gauges = {name: Gauge(f"pdserve_planner_{name}", doc, registry=registry) for name, doc in (
            ("ttft_attainment", "Share of the last window's requests within the TTFT SLO (NaN: none finished)"),
            ("tpot_attainment", "Share of the last window's requests within the TPOT SLO (NaN: none finished)"),
            ("prefill_queue", "Prompts routed to prefill workers and not yet prefilled, at the last window's end"),
            ("decode_queue", "Requests waiting on decode or colocated workers, at the last window's end"),
            ("decode_kv_use", "Share of the decode (or colocated) pool's KV blocks in use, at the last window's end"))}
        return cls(decisions, gauges)

    def export(self, snap: Snapshot, plan: Plan) -> None:
        self.decisions.labels(plan.action, plan.reason).inc()
        for name, gauge in self.gauges.items():
            value = getattr(snap, name)
            gauge.set(math.nan if value is None else value)


class Planner(Background):
    """Samples the router owned by `control`, decides, applies. `step()` is one window
    (what a test drives); `start()` runs it every `interval_s` of the router's clock."""

    def __init__(self, control: ControlPlane, cfg: PlannerConfig, interval_s: float = 3.0, swap_timeout_s: float = 300.0,
                 predictor: Predictor | None = None, cpu_seconds: Callable[[], float] = time.process_time) -> None:
        if not interval_s > 0:
            raise ValueError(f"planner interval must be > 0 s, got {interval_s}")
        self.control = control
        self.router = control.router
        self.cfg = cfg
        self.interval_s = interval_s
        self.swap_timeout_s = swap_timeout_s  # a swap whose new workers never all serve is abandoned
        self.predictor = predictor  # one host: both layouts' scores for the latest requests (planner_predict.py)
        self.state = PlannerState()
        self.swap: Swap | None = None
        self.metrics = PlannerMetrics.create(self.router.metrics.registry)
        self.last: tuple[Snapshot, Plan] | None = None
        self._last_reason = ""
        self._settled_at: float | None = 0.0  # when the pools last stopped changing (None: changing now)
        self._predicted: tuple[float, tuple] | None = None  # (when, scores) of the last prediction
        self._due: tuple[float, int, float] | None = None  # a replay the loop owes: (now, KV blocks a worker, CPU a token)
        self.cpu_seconds = cpu_seconds  # this process's CPU (every thread's): the router's own
        self._cpu: collections.deque = collections.deque()  # (when, cpu_seconds(), serving) at each window
        self._idle_rates: collections.deque = collections.deque(maxlen=IDLE_SAMPLES)  # CPU s / s, idle windows
        self.router_cpu_per_token_s: float | None = None  # what the last prediction priced (None: too few tokens)
        self._inline = True  # step() driven directly: a replay runs in it

    @property
    def clock(self) -> Clock:
        return self.router.clock

    async def _loop(self) -> None:
        while True:
            await self.clock.sleep_async(self.interval_s)
            self._inline = False  # predictions replay in a thread, off the router's event loop
            try:
                self.step()
                if self._due is not None:  # ready for the next window
                    (now, blocks, cpu), self._due = self._due, None
                    await asyncio.to_thread(self._replay, now, list(self.router.finished_log), blocks, cpu)
            except Exception as e:  # a bug must not end planning, nor the router
                print(f"planner: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def step(self) -> Plan:
        """One window: advance a swap under way, then sample, decide, apply, log, export."""
        self._sample_cpu()
        self._advance_swap()
        snap = self.snapshot()
        plan, self.state = decide(snap, self.state, self.cfg)
        refusal = self._apply(plan) if plan.action != NONE else None
        logged = plan.line() + (f": refused: {refusal}" if refusal else "")
        if refusal:
            plan = Plan(plan.action, "refused", plan.role, plan.from_role, plan.count, plan.num_threads, plan.figures)
        self.metrics.export(snap, plan)
        if plan.action != NONE or plan.reason != self._last_reason:
            print(logged, file=sys.stderr, flush=True)
        self._last_reason = plan.reason
        self.last = (snap, plan)
        return plan

    # ---- sampling ------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The window's figures; its requests sent since the pools last stopped changing
        (`_settled_at`) are scored apart, for the rule's memory of this layout."""
        now = self.clock.monotonic()
        pools = self.pools()
        if pools.changing:
            self._settled_at = None
        elif self._settled_at is None:
            self._settled_at = now
        log = self.router.finished_log
        window = [r for r in log if r[0] > now - self.interval_s]
        judged = window + self._earlier(log, now, self.cfg.min_requests - len(window))
        ttft, tpot = self._attainments(judged)
        settled = [r for r in window if self._settled_at is not None and r[3] >= self._settled_at]
        reg = self.router.registry
        prefill, kv_side = reg.live(("prefill",)), reg.live(("decode", "colocated"))
        total = sum(e.status.total_blocks for e in kv_side if e.status)
        free = sum(e.status.free_blocks for e in kv_side if e.status)
        # near the target (under it + margin): the rule may act on a prediction (planner.py `_predicted_ahead`)
        low = any(a is not None and a < self.cfg.target + self.cfg.margin for a in (ttft, tpot))
        cooling = self.state.last_plan_at is not None and now - self.state.last_plan_at < self.cfg.cooldown_s
        predicted = self._predict(now, max((e.status.total_blocks for e in kv_side if e.status), default=0)) \
            if low and not (pools.changing or cooling) else ()
        return Snapshot(now, len(window), ttft, tpot,
                        sum(e.inflight for e in prefill), sum(e.status.waiting for e in kv_side if e.status),
                        1 - free / total if total else 0.0, pools, len(settled), score(*self._attainments(settled)),
                        len(judged), predicted, awaiting_prediction=self._predicted is None and self._due is not None,
                        router_cpu_ms_per_token=None if self.router_cpu_per_token_s is None
                        else round(self.router_cpu_per_token_s * 1e3, 3),
                        load=self._load(log, now), tpot_judged=sum(r[2] is not None for r in judged))

    def _load(self, log, now: float) -> Load | None:
        """Requests sent a second over the last LOAD_S (or since the first the log holds,
        where that is later), and their mean prompt and output lengths; None for fewer
        than LOAD_MIN. Requests still running are not counted: a rate some percent low,
        the same at every window of one load, which is what the rule compares."""
        recent = [r for r in log if r[3] >= now - LOAD_S]
        if len(recent) < LOAD_MIN:
            return None
        span = min(LOAD_S, now - min(r[3] for r in log))
        return Load(len(recent) / max(span, self.interval_s), sum(r[4] for r in recent) / len(recent),
                    sum(r[5] for r in recent) / len(recent), len(recent))

    def _sample_cpu(self) -> None:
        now, cpu = self.clock.monotonic(), self.cpu_seconds()
        serving = self.router.busy > 0
        if self._cpu:
            t0, c0, was_serving = self._cpu[-1]
            if now > t0 and not (was_serving or serving or self._finished_since(t0)):
                self._idle_rates.append(max(0.0, cpu - c0) / (now - t0))
        self._cpu.append((now, cpu, serving))
        while len(self._cpu) > 2 and self._cpu[1][0] <= now - PREDICT_S:
            self._cpu.popleft()

    def _finished_since(self, t0: float) -> bool:
        log = self.router.finished_log
        return bool(log) and log[-1][0] > t0  # finish order: the latest is last

    def idle_cpu_rate(self) -> float:
        """The router's CPU seconds a second with nothing to serve (heartbeats, windows,
        metrics): the median over its last IDLE_SAMPLES windows that had no request in
        flight at either end and none finishing between; 0 before the first."""
        return statistics.median(self._idle_rates) if self._idle_rates else 0.0

    def cpu_per_token(self) -> float | None:
        """The router's CPU seconds per token it streamed, over the last PREDICT_S (the
        requests a prediction replays): this process's CPU between the oldest and the
        latest window sample, less its idle rate over that time (which lands on whichever
        core is free, not on a step: at a low rate it is most of the raw figure), over the
        output tokens of the requests that finished between them. It covers the per-token
        relay, each request's own work and what the busy router does beside (replays),
        spread over the tokens. None under CPU_MIN_TOKENS."""
        if len(self._cpu) < 2:
            return None
        (t0, c0, _), (t1, c1, _) = self._cpu[0], self._cpu[-1]
        tokens = sum(r[5] for r in self.router.finished_log if len(r) >= 6 and t0 < r[0] <= t1)
        if tokens < CPU_MIN_TOKENS:
            return None
        return max(0.0, c1 - c0 - self.idle_cpu_rate() * (t1 - t0)) / tokens

    def _predict(self, now: float, num_blocks: int) -> tuple:
        """Both layouts' predicted scores for the latest requests (the last replay's, for
        REFRESH_S); () without a predictor. Where the last is older, a new replay runs
        here when `step()` is driven directly, else it is left to the loop, which runs it
        in a thread after this window (a replay takes 40-165 ms of CPU: on the router's
        event loop it would stall every stream), and this window has the older one."""
        if self.predictor is None:
            return ()
        if self._predicted is None or now - self._predicted[0] >= REFRESH_S:
            cpu = self.cpu_per_token()
            self.router_cpu_per_token_s = cpu
            if self._inline:
                self._replay(now, list(self.router.finished_log), num_blocks, cpu or 0.0)
            else:
                self._due = (now, num_blocks, cpu or 0.0)
        return self._predicted[1] if self._predicted is not None else ()

    def _replay(self, now: float, finished: list, num_blocks: int, cpu_per_token_s: float = 0.0) -> None:
        try:
            scores = self.predictor.scores(finished, now, num_blocks, cpu_per_token_s)
        except Exception as e:  # a prediction is advice: its failure must not stop planning
            print(f"planner: prediction failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            scores = ()
        self._predicted = (now, scores)

    def _earlier(self, log, now: float, n: int) -> list:
        """The latest `n` requests that finished before this window and were sent since the
        pools last stopped changing: what a window of few requests is judged together
        with, so that at a low rate one request does not decide (none while pools change)."""
        if n <= 0 or self._settled_at is None:
            return []
        out = []
        for r in reversed(log):
            if len(out) == n or r[0] <= self._settled_at:
                break
            if r[0] <= now - self.interval_s and r[3] >= self._settled_at:
                out.append(r)
        return out

    def _attainments(self, finished: list) -> tuple[float | None, float | None]:
        """TTFT and TPOT attainment of finished requests (finished_log entries)."""
        return (share([r[1] for r in finished], self.cfg.ttft_slo_s),
                share([r[2] for r in finished if r[2] is not None], self.cfg.tpot_slo_s))

    def pools(self) -> Pools:
        counts = {"prefill": 0, "decode": 0, "colocated": 0}
        changing = int(self.swap is not None)
        for w in self.control.pools():
            if w.state == SERVING and w.role in counts:
                counts[w.role] += 1
            changing += w.state in CHANGING
        return Pools(counts["prefill"], counts["decode"], counts["colocated"], changing)

    # ---- applying ------------------------------------------------------------------------
    def _apply(self, plan: Plan) -> str | None:
        """Start `plan`; the control API's refusal, if it refused (the plan is counted
        under reason `refused`)."""
        try:
            if plan.action == ADD:
                self.control.scale(plan.role, plan.count)
            elif plan.action == REROLE:
                donors = sorted(self.router.registry.live((plan.from_role,)), key=lambda e: (e.inflight, e.worker_id))
                self.control.change_role(donors[0].worker_id, plan.role)
            elif plan.action in (SPLIT, MERGE):
                self._start_swap(plan)
        except PoolError as e:
            return str(e)
        return None

    def _start_swap(self, plan: Plan) -> None:
        engine = {"num_threads": plan.num_threads}
        if plan.action == SPLIT:
            old = [e.worker_id for e in self.router.registry.live(("colocated",))]
            new = self.control.scale("prefill", 1, engine).worker_ids + self.control.scale("decode", 1, engine).worker_ids
        else:
            old = [e.worker_id for e in self.router.registry.live(("prefill", "decode"))]
            new = self.control.scale("colocated", 1, engine).worker_ids
        self.swap = Swap(list(new), old, self.clock.monotonic())

    def _advance_swap(self) -> None:
        """Drain a swap's old workers once all its new ones serve; abandon it (old ones
        kept) if a new one left or the swap outlived `swap_timeout_s`."""
        swap = self.swap
        if swap is None:
            return
        reg = self.router.registry
        states = {w.worker_id: w.state for w in self.control.pools()}
        if all(w in reg.workers and reg.workers[w].alive and reg.workers[w].state == SERVING for w in swap.new):
            self.swap = None
            old = [w for w in swap.old if w in reg.workers and reg.workers[w].state == SERVING]
            try:
                if old:
                    self.control.drain(old)
                said = f"draining {', '.join(old) or 'none'}"
            except PoolError as e:
                said = f"keeping {', '.join(old)}: {e}"
            print(f"planner: new workers {', '.join(swap.new)} serve; {said}", file=sys.stderr, flush=True)
        elif any(states.get(w) in ("exited", None) for w in swap.new) or \
                self.clock.monotonic() - swap.started_at > self.swap_timeout_s:
            self.swap = None
            print(f"planner: abandoned a swap: new workers {', '.join(f'{w}={states.get(w)}' for w in swap.new)}; "
                  f"keeping {', '.join(swap.old)}", file=sys.stderr, flush=True)
