"""The SLO planner's rule: from one window's figures (`Snapshot`) and what it remembers
(`PlannerState`), one pool change or none (`Plan`). Pure: no clock, no I/O; the loop
that samples the router, applies a plan and exports the figures is router/planner/loop.py.
docs/slo.md "Planner".

Each window the rule names what the figures ask for (its wish):
  prefill    TTFT attainment below target, and prompts wait on the prefill pool at least
             as much as on the decode pool: more prefill capacity
  decode     TPOT attainment below target, or decode KV use above `kv_high`, or TTFT
             below target with requests waiting for a decode worker: more decode capacity
  split      (one host, `host_cores` >= 2) colocated workers only and TPOT below target:
             prefills stall the decodes they share a worker with; 1P+1D with half the
             cores each
  merge      (one host) a P/D split whose TTFT is below target while neither pool has a
             queue and TPOT has room: the prompt itself is slow on its share of the
             cores; or whose TPOT is below target while nothing waits for decode: the
             decode step itself is slow on its share; one colocated worker with all of them
  none       both within target, or no finished request to judge by, or fewer than
             `min_requests` sent since the pools last changed (`few_requests`; decode KV
             use above `kv_high` still asks for decode capacity)
"Below target" is beyond the noise of the few requests a window holds where `miss_z` > 0:
the upper end of the attainment's Wilson interval at that z is below the target (`_missed`).

On one host the rule also remembers how each layout (colocated, split) did: a score per
window (the lower of the TTFT and TPOT attainments of the requests sent after the layout
was in place, so none that lived through the change), averaged over the windows the
layout held (each weighted by those requests), outside cooldowns, with the load it was
measured under (`Load`, router/planner/memory.py: arrival rate, mean prompt and output length). A score applies
once it counts `min_requests` requests, while the load is like it (each figure within
`load_band` x of the remembered one; the rates also within `RATE_Z` Poisson standard
errors of each other) and for at most `memory_s` after the layout was last
seen: under a steady load the choice stands, a load that moved makes the planner measure
again, and a layout tried over a few requests is not judged by them. A
layout remembered better than the current one
by more than `margin` and than `confidence_z` standard errors of the two scores' difference
(a score of few requests is noisy) is a wish of its own (`split_better_before`, `colocated_better_before`),
and a split or merge toward a layout remembered no better than the current one (beyond
that same noise) is not made (`split_worse_before`, `merge_worse_before`): what a layout does at this load is
measured, not guessed, once both have been tried at this load. Until then a prediction may
stand in: where the window carries both layouts' predicted scores (`Snapshot.predicted`, the
latest requests simulated on each: router/planner/predict.py), a split or merge toward a
layout predicted worse than the current one by more than `margin` is not made
(`split_predicted_worse`, `merge_predicted_worse`), nor one while the first prediction is
being made (`*_awaiting_prediction`); and a layout within the SLO but near it (score
under target + margin) moves to the other where the models predict this one under the
target and the other at or above it (`split_predicted_better`, `merge_predicted_better`):
at a low rate a few misses in a window are all the evidence there is for a long time.

A wish becomes a plan only after it held `sustain` consecutive windows, not within
`cooldown_s` of the last plan, not while an earlier change is under way, and only if its
predicted effect would not make the opposite rule fire (the dead band): capacity moves
from the other pool only while that pool's attainment is `margin` above target and its
KV use would stay below `kv_high` with one worker fewer. Capacity comes from the other
pool (a role change) where it can, else from a new worker while the deployment holds
fewer than `max_workers`."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdserve.router.planner.memory import Load, Remembered
from pdserve.router.stats.intervals import wilson_interval

NONE, ADD, REROLE, SPLIT, MERGE = "none", "add", "re_role", "split", "merge"
WISHES = ("prefill", "decode", "split", "merge")


@dataclass(frozen=True)
class PlannerConfig:
    """The targets and the hysteresis. SLOs in seconds; `target` is the share of a
    window's requests that must meet each SLO."""

    ttft_slo_s: float
    tpot_slo_s: float
    target: float = 0.9
    margin: float = 0.05      # dead band: the donor pool's attainment must exceed target + margin
    kv_high: float = 0.9      # decode KV use above this asks for decode capacity
    sustain: int = 2          # consecutive windows a wish must hold
    cooldown_s: float = 15.0  # no plan this soon after the last
    max_workers: int = 0      # workers the planner may grow the deployment to (0: role changes only)
    host_cores: int = 0       # one host: the cores its workers share (0: core sharing is not planned)
    memory_s: float = 1800.0  # one host: the longest a layout's observed score is trusted
    load_band: float = 1.5    # ... and only while each figure of the load is within this factor of its own
    min_requests: int = 1     # attainment is judged, and a layout's score counts, over at least this many requests
    confidence_z: float = 1.28  # one host: a remembered score beats another by margin + this many standard errors
    miss_z: float = 0.0       # a window misses the target only where its Wilson interval at this z lies below it (0: the share itself)

    def __post_init__(self) -> None:
        if not (self.ttft_slo_s > 0 and self.tpot_slo_s > 0):
            raise ValueError("planner SLOs must be > 0")
        if not 0 < self.target <= 1 or self.margin < 0 or not 0 < self.kv_high <= 1:
            raise ValueError("planner target must be in (0, 1], margin >= 0, kv_high in (0, 1]")
        if self.sustain < 1 or min(self.cooldown_s, self.max_workers, self.host_cores, self.memory_s) < 0:
            raise ValueError("planner sustain must be >= 1; cooldown, max_workers, host_cores and memory_s >= 0")
        if not self.load_band >= 1 or self.min_requests < 1 or self.confidence_z < 0 or not self.miss_z >= 0:
            raise ValueError(f"planner load_band must be >= 1, min_requests >= 1, confidence_z and miss_z >= 0, got "
                             f"{self.load_band}, {self.min_requests}, {self.confidence_z}, {self.miss_z}")


@dataclass(frozen=True)
class Pools:
    """Serving workers per role, and workers on their way in or out (starting, draining, exiting)."""

    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    changing: int = 0

    @property
    def total(self) -> int:
        return self.prefill + self.decode + self.colocated


@dataclass(frozen=True)
class Snapshot:
    """One window's figures. Attainments are None where no finished request had the
    figure. Queues count requests: prompts routed to prefill workers and not yet
    prefilled; requests waiting on decode (or colocated) workers."""

    now: float  # monotonic seconds at the window's end
    finished: int
    ttft_attainment: float | None
    tpot_attainment: float | None
    prefill_queue: int
    decode_queue: int
    decode_kv_use: float  # share of the decode (or colocated) pool's KV blocks in use
    pools: Pools
    # the window's requests sent after the current layout was in place: how many and
    # their score (`score`); None: the same as the window's own (no change to leave out)
    layout_finished: int | None = None
    layout_score: float | None = None
    # the requests the attainments are over: the window's, and where it held fewer than
    # the loop's minimum, the latest before it sent since the pools last changed (None: the window's)
    judged: int | None = None
    # one host: ((layout, score), ...) the latency models predict for the latest requests
    # on each layout (router/planner/predict.py); () where not predicted
    predicted: tuple[tuple[str, float], ...] = ()
    awaiting_prediction: bool = False  # the first prediction is being made: no split or merge yet
    router_cpu_ms_per_token: float | None = None  # what the prediction priced the router's CPU at (None: not)
    load: Load | None = None  # the load of the latest minutes (None: too few requests to say)
    tpot_judged: int | None = None  # the judged requests with a TPOT (None: as many as `judged`)

    def figures(self) -> dict[str, float]:
        """The numbers a decision is logged and exported with."""
        out = {"finished": self.finished, "prefill_queue": self.prefill_queue, "decode_queue": self.decode_queue,
               "decode_kv_use": round(self.decode_kv_use, 3), "prefill": self.pools.prefill,
               "decode": self.pools.decode, "colocated": self.pools.colocated, "changing": self.pools.changing}
        if self.judged is not None and self.judged != self.finished:
            out["judged"] = self.judged
        for name in ("ttft_attainment", "tpot_attainment"):
            if getattr(self, name) is not None:
                out[name] = round(getattr(self, name), 3)
        for layout, value in self.predicted:
            out[f"predicted_{layout}"] = value
        if self.predicted and self.router_cpu_ms_per_token is not None:
            out["router_cpu_ms_per_token"] = self.router_cpu_ms_per_token
        if self.load is not None:
            out["load_rate"] = round(self.load.rate, 3)
            out["load_requests"] = self.load.requests
        return out


@dataclass(frozen=True)
class Plan:
    """What to do: `action` of `role` (add: a new worker; re_role: one `from_role`
    worker restarted as `role`; split / merge: new workers with `num_threads` each, then
    the old ones drained), and why."""

    action: str
    reason: str
    role: str = ""
    from_role: str = ""
    count: int = 0
    num_threads: int = 0  # 0: the deployment's own
    figures: dict = field(default_factory=dict)

    def line(self) -> str:
        what = {NONE: "no change", ADD: f"add {self.count} {self.role} worker(s)",
                REROLE: f"re-role a {self.from_role} worker to {self.role}",
                SPLIT: f"split colocated into 1 prefill + 1 decode worker with {self.num_threads} thread(s) each",
                MERGE: f"merge prefill + decode into 1 colocated worker with {self.num_threads} thread(s)"}[self.action]
        figs = " ".join(f"{k}={v}" for k, v in self.figures.items())
        return f"planner: {what} ({self.reason}): {figs}"


@dataclass(frozen=True)
class PlannerState:
    """What the rule remembers between windows."""

    wish: str = NONE
    streak: int = 0
    last_plan_at: float | None = None
    memory: tuple[Remembered, ...] = ()  # one host: per layout tried


def decide(snap: Snapshot, state: PlannerState, cfg: PlannerConfig) -> tuple[Plan, PlannerState]:
    """This window's plan and the state the next window starts from."""
    figs = snap.figures()
    if snap.pools.changing:
        return Plan(NONE, "changing", figures=figs), replace(state, wish=NONE, streak=0)
    if state.last_plan_at is not None and snap.now - state.last_plan_at < cfg.cooldown_s:
        return Plan(NONE, "cooldown", figures=figs), replace(state, wish=NONE, streak=0)
    state = replace(state, memory=_remember(state.memory, snap, cfg))
    wish, why = _wish(snap, cfg, state.memory)
    if why in ("idle", "few_requests"):  # no evidence either way yet: the count holds
        return Plan(NONE, why, figures=figs), state
    streak = state.streak + 1 if wish == state.wish else 1
    if wish == NONE:
        return Plan(NONE, why, figures=figs), PlannerState(NONE, 0, state.last_plan_at, state.memory)
    held = replace(state, wish=wish, streak=streak)
    if streak < cfg.sustain:
        return Plan(NONE, f"{why}_pending", figures=figs), held
    plan = _plan(wish, why, snap, cfg)
    if plan.action == NONE:
        return replace(plan, figures=figs), held
    return replace(plan, figures=figs), PlannerState(NONE, 0, snap.now, state.memory)


def _wish(snap: Snapshot, cfg: PlannerConfig, memory: tuple = ()) -> tuple[str, str]:
    """What this window's figures ask for, and the reason's name."""
    n = snap.judged if snap.judged is not None else snap.finished
    ttft_low = _missed(snap.ttft_attainment, n, cfg)
    tpot_low = _missed(snap.tpot_attainment, snap.tpot_judged if snap.tpot_judged is not None else n, cfg)
    kv_high = snap.decode_kv_use > cfg.kv_high
    p = snap.pools
    if snap.finished == 0 and not kv_high:
        return NONE, "idle"
    if snap.judged is not None and snap.judged < cfg.min_requests and not kv_high:
        return NONE, "few_requests"  # too few since the pools last changed to judge by: the count holds
    here = _layout(p) if cfg.host_cores >= 2 else None
    if here is not None and (ttft_low or tpot_low):
        better = _better_elsewhere(memory, here, snap, cfg)
        if better is not None:
            return better
    elif here is not None:
        ahead = _predicted_ahead(here, snap, memory, cfg)
        if ahead is not None:
            return ahead
    if here == "colocated":
        if not tpot_low:
            return NONE, "within_slo"
        return _swap(SPLIT, "tpot_interference", snap, memory, cfg)
    if not (p.prefill and p.decode):
        return NONE, "within_slo" if not (ttft_low or tpot_low) else "no_pd_pools"
    if tpot_low and here == "split" and snap.decode_queue == 0 and not kv_high:
        # nothing waits for decode: its step on its share of the cores is itself too slow
        return _swap(MERGE, "tpot_slow_step", snap, memory, cfg)
    if tpot_low or kv_high:
        return "decode", "decode_kv" if kv_high and not tpot_low else "tpot_low"
    if ttft_low and snap.decode_queue > snap.prefill_queue:
        return "decode", "decode_queue"
    if ttft_low and here == "split" and snap.prefill_queue == 0 and snap.decode_queue == 0 \
            and not _below(snap.tpot_attainment, cfg.target + cfg.margin):
        return _swap(MERGE, "ttft_unqueued", snap, memory, cfg)
    if ttft_low:
        return "prefill", "ttft_low"
    return NONE, "within_slo"


def _swap(action: str, why: str, snap: Snapshot, memory: tuple, cfg: PlannerConfig) -> tuple[str, str]:
    """A split or merge, unless the other layout was tried under this load and scored no
    better than this one beyond the noise of the two scores (`_beats`; `*_worse_before`:
    over 10 requests each, 80% against 60% is two requests, not a reason to swap back, and
    a swap costs a window) or, where the two were not both measured under this load, is
    predicted to do worse by more than `margin` (`*_predicted_worse`): a score of the
    other alone, with nothing of this layout's to set it against, does not outrank the
    prediction (at a new rate the layout in place has no score yet)."""
    here = "colocated" if action == SPLIT else "split"
    other, name = _other(here), "split" if action == SPLIT else "merge"
    theirs, ours = _entry(memory, other, snap, cfg), _entry(memory, here, snap, cfg)
    if theirs is not None and ours is not None and not _beats(theirs, ours, cfg):
        return NONE, f"{name}_worse_before"
    predicted = dict(snap.predicted)
    if theirs is None or ours is None:
        if snap.awaiting_prediction:
            return NONE, f"{name}_awaiting_prediction"
        if here in predicted and other in predicted and predicted[other] < predicted[here] - cfg.margin:
            return NONE, f"{name}_predicted_worse"
    return action, why


def _predicted_ahead(here: str, snap: Snapshot, memory: tuple, cfg: PlannerConfig) -> tuple[str, str] | None:
    """Within the SLO but near it (the window's score under target + margin): the move to
    the other layout where it was not tried and the latency models predict this one under
    the target and the other at or above it, by more than `margin` (`split_predicted_better`,
    `merge_predicted_better`). A layout measured worse after the move is undone by the
    rules above, and a remembered score outranks the prediction."""
    current = score(snap.ttft_attainment, snap.tpot_attainment)
    if current is None or current >= cfg.target + cfg.margin:
        return None
    other = _other(here)
    predicted = dict(snap.predicted)
    if here not in predicted or other not in predicted or _recalled(memory, other, snap, cfg) is not None:
        return None
    if predicted[here] < cfg.target <= predicted[other] and predicted[other] - predicted[here] > cfg.margin:
        return (SPLIT, "split_predicted_better") if other == "split" else (MERGE, "merge_predicted_better")
    return None


def _layout(p: Pools) -> str | None:
    """One host's layout: colocated workers only, or prefill and decode workers only."""
    if p.colocated and not (p.prefill or p.decode):
        return "colocated"
    if p.prefill and p.decode and not p.colocated:
        return "split"
    return None


def _other(layout: str) -> str:
    """One host's other layout: "split" for "colocated" and back."""
    return "split" if layout == "colocated" else "colocated"


def score(ttft_attainment: float | None, tpot_attainment: float | None) -> float | None:
    """A window's score: the lower of its TTFT and TPOT attainments (None: neither known)."""
    known = [a for a in (ttft_attainment, tpot_attainment) if a is not None]
    return min(known) if known else None


def share(values: list[float], slo_s: float) -> float | None:
    """The share of `values` (seconds) within `slo_s`; None for none."""
    return sum(v <= slo_s for v in values) / len(values) if values else None


def _remember(memory: tuple, snap: Snapshot, cfg: PlannerConfig) -> tuple:
    """`memory` with this window's score counted into its layout's mean (one host only):
    the score of its requests sent after the layout was in place."""
    own = snap.layout_finished is None
    layout = _layout(snap.pools) if cfg.host_cores >= 2 else None
    value, finished = (score(snap.ttft_attainment, snap.tpot_attainment), snap.finished) if own \
        else (snap.layout_score, snap.layout_finished)
    if layout is None or value is None or snap.pools.changing:
        return memory
    old = next((m for m in memory if m.layout == layout and m.applies(snap.now, snap.load, cfg)), None)
    mean, n = (old.score, old.requests) if old else (0.0, 0)
    k = max(1, finished)  # a window counts as many times as it finished requests
    load = snap.load if snap.load is not None else old.load if old else None
    entry = Remembered(layout, (mean * n + value * k) / (n + k), n + k, snap.now, load)
    return (*(m for m in memory if m.layout != layout), entry)


def _recalled(memory: tuple, layout: str, snap: Snapshot, cfg: PlannerConfig) -> float | None:
    """`layout`'s remembered score, where it applies and counts `min_requests` requests."""
    m = _entry(memory, layout, snap, cfg)
    return m.score if m is not None else None


def _entry(memory: tuple, layout: str, snap: Snapshot, cfg: PlannerConfig) -> Remembered | None:
    return next((m for m in memory if m.layout == layout and m.requests >= cfg.min_requests
                 and m.applies(snap.now, snap.load, cfg)), None)


def _beats(a: Remembered, b: Remembered, cfg: PlannerConfig) -> bool:
    """Whether score `a` is above `b` by more than `margin` and by more than `confidence_z`
    standard errors of the difference of two shares (pooled): over 10 requests each, 90%
    against 80% is one request, not a better layout; over 60 each it is."""
    pooled = (a.score * a.requests + b.score * b.requests) / (a.requests + b.requests)
    se = (pooled * (1 - pooled) * (1 / a.requests + 1 / b.requests)) ** 0.5
    return a.score - b.score > max(cfg.margin, cfg.confidence_z * se)


def _better_elsewhere(memory: tuple, here: str, snap: Snapshot, cfg: PlannerConfig) -> tuple[str, str] | None:
    """The move to the other layout where it scored above this one by more than `margin`
    and than the noise of the two scores (`_beats`)."""
    other = _other(here)
    theirs, ours = _entry(memory, other, snap, cfg), _entry(memory, here, snap, cfg)
    if theirs is None or ours is None or not _beats(theirs, ours, cfg):
        return None
    return (SPLIT, "split_better_before") if other == "split" else (MERGE, "colocated_better_before")


def _plan(wish: str, why: str, snap: Snapshot, cfg: PlannerConfig) -> Plan:
    """The change that grants `wish`, or none (and why not)."""
    p = snap.pools
    if wish == SPLIT:
        return Plan(SPLIT, why, num_threads=cfg.host_cores // 2)
    if wish == MERGE:
        return Plan(MERGE, why, num_threads=cfg.host_cores)
    donor = "decode" if wish == "prefill" else "prefill"
    if _donor_has_slack(donor, snap, cfg):
        return Plan(REROLE, why, role=wish, from_role=donor, count=1)
    if cfg.host_cores:
        return Plan(NONE, f"{why}_no_core_free")  # one host: a new worker would take a core in use
    if p.total < cfg.max_workers:
        return Plan(ADD, why, role=wish, count=1)
    return Plan(NONE, f"{why}_at_max_workers")


def _donor_has_slack(donor: str, snap: Snapshot, cfg: PlannerConfig) -> bool:
    """Whether `donor` can give up a worker without the opposite rule wanting it back."""
    n = snap.pools.prefill if donor == "prefill" else snap.pools.decode
    if n < 2:
        return False
    good = cfg.target + cfg.margin
    if donor == "decode":
        kv_after = snap.decode_kv_use * n / (n - 1)
        return not _below(snap.tpot_attainment, good) and kv_after <= cfg.kv_high and snap.decode_queue == 0
    return not _below(snap.ttft_attainment, good) and snap.prefill_queue == 0


def _missed(attainment: float | None, n: int, cfg: PlannerConfig) -> bool:
    """Whether a window's attainment over `n` requests misses the target: the share itself
    below it (`miss_z` 0), or the upper end of its Wilson interval at `miss_z` also below it
    -- over 7 requests, 6 on time (86%) is one late request, not a layout that fails 90%
    (the interval at z 1.28 reaches 96%); 6 of 10 is (77% at most)."""
    if attainment is None:
        return False
    if cfg.miss_z <= 0 or n <= 0:
        return attainment < cfg.target
    return wilson_interval(round(attainment * n), n, cfg.miss_z)[1] < cfg.target


def _below(attainment: float | None, bar: float) -> bool:
    return attainment is not None and attainment < bar
