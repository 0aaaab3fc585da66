"""The SLO planner's loop (router/planner/loop.py) on a ManualClock, against a fake
control plane and a synthetic load whose TTFT depends on the prefill pool's size: the
planner moves capacity once, then, the load steady and within SLO, changes nothing;
a split on one host drains the colocated worker only after both new workers serve;
decisions are exported as metrics."""
from __future__ import annotations

import asyncio
import random
import re

from pdserve.common.clock import ManualClock
from pdserve.router.planner.rule import NONE, REROLE, SPLIT, PlannerConfig
from pdserve.router.planner.loop import Planner
from tests.support.planner_fakes import INTERVAL, FakeControl


def load(control: FakeControl, rng: random.Random, demand: float, per_window: int = 20) -> None:
    """The coming window's finished requests: TTFT within 0.5 s when the prefill pool (or the
    colocated workers) can take `demand`, prompts queued otherwise; TPOT within SLO
    unless a colocated worker's prefills stall its decodes."""
    now = control.router.clock.monotonic()
    prefill = control.serving("prefill") or control.serving("colocated")
    colocated_only = control.serving("colocated") and not control.serving("prefill")
    for i in range(per_window):
        ttft = rng.uniform(0.1, 0.4) if prefill >= demand else rng.uniform(0.3, 2.0)
        tpot = rng.uniform(0.06, 0.2) if colocated_only else rng.uniform(0.01, 0.04)
        done = now + (i + 1) * INTERVAL / per_window
        control.router.finished_log.append((done, ttft, tpot, done - ttft - 63 * tpot, 256, 64))  # sent 64 tokens back
    for e in control.router.registry.workers.values():
        if e.role == "prefill":
            e.inflight = 0 if prefill >= demand else 4


async def drive(planner: Planner, control: FakeControl, windows: int, demand: float) -> list:
    """Run the planner's own loop for `windows` windows of the manual clock."""
    rng = random.Random(0)
    clock = control.router.clock
    plans = []
    planner.start()
    try:
        for _ in range(windows):
            await asyncio.sleep(0)  # the loop sleeps on the clock
            load(control, rng, demand)
            clock.advance(INTERVAL)
            for _ in range(3):
                await asyncio.sleep(0)
            plans.append(planner.last[1])
    finally:
        planner.close()
    return plans


def test_under_a_steady_load_it_moves_capacity_once_then_changes_nothing():
    clock = ManualClock()
    control = FakeControl(clock, {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"})
    planner = Planner(control, PlannerConfig(0.5, 0.05, sustain=3, cooldown_s=30.0, max_workers=4), INTERVAL)
    plans = asyncio.run(drive(planner, control, 60, demand=2))
    acted = [(i, p) for i, p in enumerate(plans) if p.action != NONE]
    assert [(i, p.action, p.role) for i, p in acted] == [(2, REROLE, "prefill")], acted
    assert control.calls == [("change_role", "decode-0", "prefill")]
    assert (control.serving("prefill"), control.serving("decode")) == (2, 1)
    assert {p.reason for p in plans[10:]} == {"within_slo"}  # settled: no change for 50 windows
    text = control.router.metrics.render().decode()
    assert re.search(r'^pdserve_planner_decisions_total\{action="re_role",reason="ttft_low"\} 1\.0$', text, re.M)
    assert re.search(r'^pdserve_planner_decisions_total\{action="none",reason="within_slo"\} (\d+)', text, re.M)
    assert re.search(r"^pdserve_planner_ttft_attainment 1\.0$", text, re.M), text


def test_steady_load_within_slo_from_the_start_changes_nothing():
    clock = ManualClock()
    control = FakeControl(clock, {"prefill-0": "prefill", "decode-0": "decode"})
    planner = Planner(control, PlannerConfig(0.5, 0.05, sustain=3, max_workers=8), INTERVAL)
    plans = asyncio.run(drive(planner, control, 40, demand=1))
    assert {p.action for p in plans} == {NONE} and control.calls == []


def test_one_host_split_starts_p_and_d_first_then_drains_the_colocated_worker():
    clock = ManualClock()
    control = FakeControl(clock, {"colocated-0": "colocated"})
    planner = Planner(control, PlannerConfig(0.5, 0.05, sustain=2, cooldown_s=30.0, host_cores=2), INTERVAL)
    plans = asyncio.run(drive(planner, control, 30, demand=1))
    assert [p.action for p in plans if p.action != NONE] == [SPLIT]
    engine = {"num_threads": 1}
    assert control.calls == [("scale", "prefill", 1, engine), ("scale", "decode", 1, engine),
                             ("drain", "colocated-0")]
    assert (control.serving("prefill"), control.serving("decode"), control.serving("colocated")) == (1, 1, 0)
    assert {p.reason for p in plans[10:]} == {"within_slo"}


def test_a_refused_change_is_logged_and_counted_and_planning_goes_on(capsys):
    from pdserve.router.core.registry import PoolError

    class Refusing(FakeControl):
        def scale(self, role: str, delta: int, engine: dict | None = None):
            raise PoolError("this router starts no workers")

    clock = ManualClock()
    control = Refusing(clock, {"prefill-0": "prefill", "decode-0": "decode"})
    planner = Planner(control, PlannerConfig(0.5, 0.05, sustain=1, cooldown_s=10.0, max_workers=4), INTERVAL)
    plans = asyncio.run(drive(planner, control, 6, demand=2))
    assert [(p.action, p.reason) for p in plans] == [("add", "refused"), (NONE, "cooldown")] * 3  # tried again
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("planner: add 1 prefill worker(s) (ttft_low): finished=20 ")
    assert err[0].endswith(": refused: this router starts no workers") and len(err) == 6, err
    text = control.router.metrics.render().decode()
    assert re.search(r'^pdserve_planner_decisions_total\{action="add",reason="refused"\} 3\.0$', text, re.M), text


def test_a_layout_is_remembered_by_the_requests_sent_after_it_was_in_place():
    """Requests that lived through a split (sent to the colocated worker, finished on the
    new pools) are not the split's: its memory holds only those sent once it served."""
    clock = ManualClock()
    control = FakeControl(clock, {"colocated-0": "colocated"})
    cfg = PlannerConfig(0.5, 0.05, sustain=2, cooldown_s=0.0, host_cores=2)
    planner = Planner(control, cfg, INTERVAL)
    log = control.router.finished_log
    control.scale("prefill", 1), control.scale("decode", 1)  # the split under way
    clock.advance(INTERVAL / 2)
    assert planner.snapshot().pools.changing == 2
    clock.advance(INTERVAL)
    control.drain(["colocated-0"])
    snap = planner.snapshot()  # the new pools serve from here
    assert (snap.pools.prefill, snap.pools.decode, snap.pools.changing) == (1, 1, 0)
    settled = clock.monotonic()
    for i in range(4):  # finished in the next window: two sent during the change (slow), two after
        sent = settled - 3.0 if i < 2 else settled + 0.1 * i
        log.append((settled + 1.0 + i, 0.2, 0.2 if i < 2 else 0.02, sent, 256, 64))
    clock.advance(INTERVAL)
    snap = planner.snapshot()
    assert (snap.finished, snap.tpot_attainment) == (4, 0.5)
    assert (snap.layout_finished, snap.layout_score) == (2, 1.0)
    planner.step()
    assert [(m[0], m[1], m[2]) for m in planner.state.memory] == [("split", 1.0, 2)]


def sparse_run(min_requests: int, windows: int = 40) -> tuple[list, FakeControl]:
    """One colocated worker at one request a window, every fourth over the TPOT SLO
    (75% attainment: below the 90% target, but a window alone is 0% or 100%)."""
    clock = ManualClock()
    control = FakeControl(clock, {"colocated-0": "colocated"})
    planner = Planner(control, PlannerConfig(0.5, 0.05, sustain=2, cooldown_s=30.0, host_cores=2,
                                             min_requests=min_requests), INTERVAL)
    plans = []
    for i in range(windows):
        clock.advance(INTERVAL)
        now = clock.monotonic()
        control.router.finished_log.append((now - 1.0, 0.2, 0.2 if i % 4 == 3 else 0.02, now - 3.0, 256, 64))
        plans.append(planner.step())
    return plans, control


def test_at_a_low_rate_a_window_is_judged_with_the_latest_requests_before_it():
    alone, _ = sparse_run(min_requests=1)
    assert {p.action for p in alone} == {NONE}  # 0% windows never hold twice in a row
    judged, control = sparse_run(min_requests=8)
    acted = [(i, p.action, p.reason) for i, p in enumerate(judged) if p.action != NONE]
    # nothing on fewer than 8 requests; the 8th (6 of 8) and the next window (6 of 8: the
    # oldest left the 8 judged) hold the wish twice
    assert {judged[i].reason for i in range(7)} == {"few_requests"}
    assert acted and acted[0] == (8, SPLIT, "tpot_interference"), acted
    assert control.calls[:2] == [("scale", "prefill", 1, {"num_threads": 1}), ("scale", "decode", 1, {"num_threads": 1})]
    assert (judged[8].figures["finished"], judged[8].figures["judged"], judged[8].figures["tpot_attainment"]) == \
        (1, 8, 0.75)


def test_the_requests_judged_with_a_window_were_sent_after_the_pools_last_changed():
    clock = ManualClock()
    control = FakeControl(clock, {"colocated-0": "colocated"})
    planner = Planner(control, PlannerConfig(0.5, 0.05, host_cores=2, min_requests=10), INTERVAL)
    log = control.router.finished_log
    for i in range(6):  # slow requests of the layout before
        log.append((1.0 + i * 0.1, 0.2, 0.2, 0.5, 256, 64))
    clock.advance(2.0)
    control.scale("prefill", 1), control.scale("decode", 1)
    clock.advance(INTERVAL / 2)
    assert planner.snapshot().pools.changing == 2
    clock.advance(INTERVAL)
    control.drain(["colocated-0"])
    settled = clock.monotonic()
    assert planner.snapshot().pools.changing == 0
    for i in range(3):  # fast requests of the split, two windows back
        log.append((settled + 1.0 + i * 0.1, 0.2, 0.02, settled + 0.5, 256, 64))
    clock.advance(3 * INTERVAL)
    log.append((clock.monotonic() - 1.0, 0.2, 0.2, clock.monotonic() - 3.0, 256, 64))  # this window's one, slow
    snap = planner.snapshot()
    assert (snap.finished, snap.judged, snap.tpot_attainment) == (1, 4, 0.75)  # not the 6 slow ones before


def test_the_load_is_the_rate_and_lengths_of_the_latest_requests():
    """Requests sent in the last LOAD_S (or since the first one logged), their mean prompt
    and output lengths; not known for fewer than LOAD_MIN."""
    from pdserve.router.planner.loop import LOAD_MIN, LOAD_S
    clock = ManualClock()
    control = FakeControl(clock, {"colocated-0": "colocated"})
    planner = Planner(control, PlannerConfig(0.5, 0.05, host_cores=2), INTERVAL)
    log = control.router.finished_log
    clock.advance(1000.0)
    for i in range(LOAD_MIN - 1):
        log.append((1000.0 + i, 0.2, 0.02, 960.0 + 10 * i, 100, 10))
    assert planner.snapshot().load is None
    log.append((1010.0, 0.2, 0.02, 990.0, 300, 30))  # 4 sent in the last 40 s, the first at 960
    load = planner.snapshot().load
    assert (load.rate, load.prompt_tokens, load.output_tokens) == (4 / 40.0, 150.0, 15.0)
    clock.advance(LOAD_S)  # every one sent more than LOAD_S ago
    assert planner.snapshot().load is None
    for i in range(8):
        log.append((clock.monotonic(), 0.2, 0.02, clock.monotonic() - 15.0 * i, 64, 16))
    assert planner.snapshot().load.rate == 8 / LOAD_S  # the log reaches back further: the whole LOAD_S
