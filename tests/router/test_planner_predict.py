"""The planner's prediction (router/planner/predict.py): latency models matched to the
one-host layouts by their threads, the latest requests replayed on each layout with
figures computed by hand, and the rule making no split or merge predicted to do worse --
until the other layout has been tried, when what was measured decides."""
from __future__ import annotations

import json

import pytest

from pdserve.common.config import ConfigError
from pdserve.router.core.config import RouterConfig
from pdserve.common.latency_model import Curve, DecodeFit, LatencyModel
from pdserve.router.planner.rule import MERGE, NONE, SPLIT, PlannerConfig, PlannerState, Pools, Remembered, Snapshot, decide
from pdserve.router.planner.predict import LayoutModels, Predictor

PREFILL_S = 0.1


def model(threads: int, step_s: float) -> LatencyModel:
    """Every prefill PREFILL_S whatever its length, every decode step `step_s`, transfers free."""
    return LatencyModel(Curve(((0.0, PREFILL_S), (4096.0, PREFILL_S))), DecodeFit(step_s, 0.0, 0.0),
                        Curve(((0.0, 0.0), (1024.0, 0.0))), {"num_threads": threads})


def write(tmp_path, name: str, m: LatencyModel) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(m.to_json()))
    return str(path)


def test_models_are_matched_to_the_layouts_by_their_threads(tmp_path):
    two, one = write(tmp_path, "two.json", model(2, 0.01)), write(tmp_path, "one.json", model(1, 0.03))
    models = LayoutModels.load(f"{one}, {two}", host_cores=2)
    assert (models.colocated.decode.base_s, models.split.decode.base_s) == (0.01, 0.03)
    for paths, cores, match in ((two, 2, r"none profiled with 1 thread\(s\) \(split\)"),
                                (f"{two},{two}", 2, "two latency models for 2 thread"),
                                (f"{one},{two}", 4, "meta.num_threads is 1"),
                                (f"{one},{two}", 1, "host-cores >= 2"),
                                (str(tmp_path / "nothing.json"), 2, "cannot read")):
        with pytest.raises(ConfigError, match=match):
            LayoutModels.load(paths, cores)
    with pytest.raises(ConfigError, match="planner_host_cores >= 2"):
        RouterConfig("m", planner="slo", slo_ttft_ms=1000, slo_tpot_ms=20, planner_latency_models=two)


def predictor(colocated_step_s: float, split_step_s: float) -> Predictor:
    models = LayoutModels(model(2, colocated_step_s), model(1, split_step_s))
    return Predictor(models, RouterConfig("m"), ttft_slo_s=1.0, tpot_slo_s=0.02, host_cores=2)


class Recording(Predictor):
    """A predictor that notes each replay: (when, the router's CPU a token it priced)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.replays: list[tuple[float, float]] = []

    def scores(self, finished, now, num_blocks=0, host_cpu_per_token_s=0.0):
        self.replays.append((now, host_cpu_per_token_s))
        return super().scores(finished, now, num_blocks, host_cpu_per_token_s)


def entry(finished: float, sent: float, prompt: int, output: int) -> tuple:
    """A router finished-log entry (its TTFT and TPOT are not what is replayed)."""
    return (finished, 0.5, 0.05, sent, prompt, output)


def test_one_request_alone_scores_as_computed_by_hand():
    # colocated: first token after the 0.1 s prefill, then 10 ms steps (TPOT 10 ms <= 20);
    # split: the same first token (free transfer), then 30 ms steps on one thread (> 20 ms)
    p = predictor(0.01, 0.03)
    assert p.requests([entry(10.0, 9.0, 32, 5)], now=10.0) == [(0.0, [1] * 32, 5)]
    assert p.scores([entry(10.0, 9.0, 32, 5)], now=10.0) == (("colocated", 1.0), ("split", 0.0))


def test_what_is_replayed_is_the_latest_minute_in_send_order_without_prefix_hits():
    p = predictor(0.01, 0.01)
    log = [entry(5.0, 4.0, 16, 2), (50.0, 0.1, None, 49.0), entry(80.0, 75.0, 64, 3), entry(79.0, 70.0, 8, 1)]
    reqs = p.requests(log, now=100.0)  # the first finished over 60 s ago; the 4-tuple has no lengths
    assert reqs == [(0.0, [1] * 8, 1), (5.0, [2] * 64, 3)]
    assert p.scores([], now=100.0) == ()


def test_a_prompt_stalling_the_decodes_it_shares_a_worker_with_is_predicted():
    # two requests sent together. Colocated: A's prefill (0-0.1 s), then B's prompt shares
    # A's next step (0.1-0.2 s), so A's tokens come at 0.1, 0.2, 0.21, 0.22: TPOT 40 ms > 20;
    # B's at 0.2-0.23: 10 ms. Split: P prefills A then B; D decodes each at 10 ms a step.
    p = predictor(0.01, 0.01)
    assert dict(p.scores([entry(9.0, 5.0, 32, 4), entry(9.0, 5.0, 40, 4)], now=10.0)) == \
        {"colocated": 0.5, "split": 1.0}


def test_the_routers_cpu_is_paid_by_steps_on_every_core():
    # one request; both layouts' decode steps take 15 ms (TPOT SLO 20 ms). With the
    # router's 10 ms of CPU a streamed token: colocated's 2 threads fill both cores, so each
    # of its steps pays it (25 ms > 20); the split's decode thread steps alone after the
    # prefill (a core free for the router) and keeps its 15 ms.
    p = predictor(0.015, 0.015)
    log = [entry(10.0, 9.0, 32, 5)]
    assert p.scores(log, now=10.0) == (("colocated", 1.0), ("split", 1.0))
    assert p.scores(log, now=10.0, host_cpu_per_token_s=0.01) == (("colocated", 0.0), ("split", 1.0))


def test_the_loop_measures_the_routers_cpu_a_token_and_prices_it():
    """CPU seconds of this process (injected) over the tokens of the requests finished
    between the first and the last window sample of the last PREDICT_S; none under
    CPU_MIN_TOKENS tokens; the replay gets it."""
    from pdserve.common.clock import ManualClock
    from pdserve.router.planner.loop import CPU_MIN_TOKENS, Planner
    from tests.support.planner_fakes import INTERVAL, FakeControl

    clock = ManualClock()
    control = FakeControl(clock, {"colocated-0": "colocated"})
    cpu = [0.0]
    recording = Recording(predictor(0.01, 0.05).models, RouterConfig("m"), 1.0, 0.02, 2)
    planner = Planner(control, PlannerConfig(1.0, 0.02, sustain=2, cooldown_s=0.0, host_cores=2), INTERVAL,
                      predictor=recording, cpu_seconds=lambda: cpu[0])
    per_window = 64  # tokens finished each window; 0.32 s of CPU each: 5 ms a token
    assert CPU_MIN_TOKENS > per_window
    figures = []
    for _ in range(5):
        clock.advance(INTERVAL)
        now = clock.monotonic()  # one request a window, over the TPOT SLO: a prediction is asked for
        control.router.finished_log.append((now - 1.0, 0.3, 0.03, now - 3.0, 64, per_window))
        cpu[0] += 0.005 * per_window
        figures.append(planner.step().figures)
    priced = [c for _, c in recording.replays]
    assert priced[0] == 0.0 and "router_cpu_ms_per_token" not in figures[0]  # no tokens between samples yet
    assert planner.cpu_per_token() == pytest.approx(0.005)
    planner._predicted = None  # the next window replays again
    clock.advance(INTERVAL)
    control.router.finished_log.append((clock.monotonic() - 1.0, 0.3, 0.03, clock.monotonic() - 3.0, 64, per_window))
    cpu[0] += 0.005 * per_window
    assert planner.step().figures["router_cpu_ms_per_token"] == 5.0
    assert recording.replays[-1][1] == pytest.approx(0.005)


def test_the_routers_idle_cpu_is_netted_out_of_its_cpu_a_token():
    """Windows with nothing in flight at either end and nothing finishing between give
    the idle rate (their median); a token is priced at the CPU beyond it. A window
    with a request in flight at one end, or one finishing in it, is not idle."""
    from pdserve.common.clock import ManualClock
    from pdserve.router.planner.loop import Planner
    from tests.support.planner_fakes import INTERVAL, FakeControl

    clock = ManualClock()
    control = FakeControl(clock, {"colocated-0": "colocated"})
    router, cpu = control.router, [0.0]
    planner = Planner(control, PlannerConfig(1.0, 0.02, sustain=2, cooldown_s=0.0, host_cores=2), INTERVAL,
                      cpu_seconds=lambda: cpu[0])
    idle = 0.01  # CPU seconds a second, nothing to serve
    for extra in (0.0, 0.0, 0.05, 0.0):  # one idle window with a transient: the median ignores it
        planner._sample_cpu()
        clock.advance(INTERVAL)
        cpu[0] += idle * INTERVAL + extra
    planner._sample_cpu()
    assert planner.idle_cpu_rate() == pytest.approx(idle)
    router.busy = 1  # a request in flight from here: no window is idle
    planner._sample_cpu()
    for _ in range(3):
        clock.advance(INTERVAL)
        cpu[0] += idle * INTERVAL + 0.004 * 100  # 4 ms of CPU a token beyond the idle rate
        router.finished_log.append((clock.monotonic() - 0.5, 0.3, 0.03, clock.monotonic() - 3.0, 64, 100))
        planner._sample_cpu()
    router.busy = 0
    clock.advance(INTERVAL)  # nothing in flight at either end, but a request finished between: not idle
    cpu[0] += 1.0
    router.finished_log.append((clock.monotonic() - 0.5, 0.3, 0.03, clock.monotonic() - 3.0, 64, 100))
    planner._sample_cpu()
    assert planner.idle_cpu_rate() == pytest.approx(idle)
    raw = (cpu[0] - planner._cpu[0][1]) / 400
    assert planner.cpu_per_token() == pytest.approx(raw - idle * (planner._cpu[-1][0] - planner._cpu[0][0]) / 400)
    assert planner.cpu_per_token() < raw


CFG = PlannerConfig(1.0, 0.02, sustain=1, cooldown_s=0.0, host_cores=2)


def window(pools: Pools, tpot: float, predicted: tuple, ttft: float = 1.0) -> Snapshot:
    return Snapshot(100.0, 10, ttft, tpot, 0, 0, 0.1, pools, predicted=predicted)


def test_no_split_where_the_split_is_predicted_worse():
    colocated = Pools(colocated=1)
    plan, _ = decide(window(colocated, 0.5, (("colocated", 0.6), ("split", 0.0))), PlannerState(), CFG)
    assert (plan.action, plan.reason) == (NONE, "split_predicted_worse")
    assert plan.figures["predicted_colocated"] == 0.6 and plan.figures["predicted_split"] == 0.0
    awaiting = Snapshot(100.0, 10, 1.0, 0.5, 0, 0, 0.1, colocated, awaiting_prediction=True)
    assert decide(awaiting, PlannerState(), CFG)[0].reason == "split_awaiting_prediction"
    for predicted in ((("colocated", 0.6), ("split", 0.58)), (("colocated", 0.6), ("split", 0.9)), ()):
        plan, _ = decide(window(colocated, 0.5, predicted), PlannerState(), CFG)
        assert (plan.action, plan.reason) == (SPLIT, "tpot_interference"), predicted  # within margin, better, none


def test_no_merge_where_colocated_is_predicted_worse():
    split = Pools(prefill=1, decode=1)
    plan, _ = decide(window(split, 0.5, (("colocated", 0.2), ("split", 0.5))), PlannerState(), CFG)
    assert (plan.action, plan.reason) == (NONE, "merge_predicted_worse")
    plan, _ = decide(window(split, 0.5, (("colocated", 0.9), ("split", 0.5))), PlannerState(), CFG)
    assert (plan.action, plan.reason) == (MERGE, "tpot_slow_step")


def test_what_was_measured_outranks_what_was_predicted():
    # the split was tried and scored 0.9 against colocated's 0.5: back to it, whatever the models say
    memory = (Remembered("colocated", 0.5, 20, 99.0), Remembered("split", 0.9, 20, 60.0))
    state = PlannerState(memory=memory)
    plan, _ = decide(window(Pools(colocated=1), 0.5, (("colocated", 0.6), ("split", 0.0))), state, CFG)
    assert (plan.action, plan.reason) == (SPLIT, "split_better_before")


def test_a_score_of_the_other_layout_alone_does_not_outrank_the_prediction():
    """At a new rate the layout in place has no score of its own yet (a window finishing
    one request, judged over the latest 10): colocated remembered at 0.8 is no reason to
    merge where the models predict colocated 0.2 against the split's 0.5. Once the split
    has a score of its own too, the two measured scores decide."""
    cfg = PlannerConfig(1.0, 0.02, sustain=1, cooldown_s=0.0, host_cores=2, min_requests=10)
    split = Pools(prefill=1, decode=1)
    state = PlannerState(memory=(Remembered("colocated", 0.8, 20, 99.0),))
    one = Snapshot(100.0, 1, 1.0, 0.5, 0, 0, 0.1, split, judged=10, predicted=(("colocated", 0.2), ("split", 0.5)))
    plan, _ = decide(one, state, cfg)
    assert (plan.action, plan.reason) == (NONE, "merge_predicted_worse")
    both = PlannerState(memory=(*state.memory, Remembered("split", 0.5, 20, 99.0)))
    plan, _ = decide(one, both, cfg)
    assert (plan.action, plan.reason) == (MERGE, "colocated_better_before")


def test_the_loop_predicts_from_the_router_log_and_holds_a_split_predicted_worse():
    from pdserve.common.clock import ManualClock
    from pdserve.router.planner.loop import Planner
    from tests.support.planner_fakes import INTERVAL, FakeControl

    clock = ManualClock()
    control = FakeControl(clock, {"colocated-0": "colocated"})
    cfg = PlannerConfig(1.0, 0.02, sustain=2, cooldown_s=0.0, host_cores=2)
    recording = Recording(predictor(0.01, 0.05).models, RouterConfig("m"), 1.0, 0.02, 2)
    planner = Planner(control, cfg, INTERVAL, predictor=recording)
    plans = []
    for _ in range(6):
        clock.advance(INTERVAL)
        now = clock.monotonic()  # each window: one request over the TPOT SLO
        control.router.finished_log.append((now - 1.0, 0.3, 0.03, now - 3.0, 64, 16))
        plans.append(planner.step())
    assert {(p.action, p.reason) for p in plans} == {(NONE, "split_predicted_worse")}
    assert (plans[-1].figures["predicted_colocated"], plans[-1].figures["predicted_split"]) == (1.0, 0.0)
    assert control.calls == [] and [t for t, _ in recording.replays] == [INTERVAL]  # one replay serves REFRESH_S (30 s)
    planner.predictor = predictor(0.01, 0.01)  # models that price both layouts alike: the split is tried
    actions = []
    for _ in range(2):
        clock.advance(INTERVAL)
        control.router.finished_log.append((clock.monotonic() - 1.0, 0.3, 0.03, clock.monotonic() - 3.0, 64, 16))
        actions.append(planner.step().action)
    assert actions == [NONE, SPLIT]  # held for sustain (2) windows


def test_near_the_target_the_layout_predicted_better_is_moved_to():
    """Within the SLO but under target + margin, the models predicting this layout under
    the target and the other at or above it: the move is made. Not at the target + margin,
    not where the present layout is predicted at the target, not where the other was
    measured (what was measured outranks what was predicted)."""
    colocated, split = Pools(colocated=1), Pools(prefill=1, decode=1)
    ahead = (("colocated", 0.8), ("split", 1.0))
    plan, _ = decide(window(colocated, 0.9, ahead), PlannerState(), CFG)
    assert (plan.action, plan.reason) == (SPLIT, "split_predicted_better")
    plan, _ = decide(window(split, 1.0, (("colocated", 1.0), ("split", 0.8)), ttft=0.9), PlannerState(), CFG)
    assert (plan.action, plan.reason) == (MERGE, "merge_predicted_better")
    for snap, state in ((window(colocated, 1.0, ahead), PlannerState()),
                        (window(colocated, 0.9, (("colocated", 0.9), ("split", 1.0))), PlannerState()),
                        (window(colocated, 0.9, ()), PlannerState()),
                        (window(colocated, 0.9, ahead),
                         PlannerState(memory=(Remembered("split", 0.85, 20, 99.0),)))):
        plan, _ = decide(snap, state, CFG)
        assert (plan.action, plan.reason) == (NONE, "within_slo"), (snap, state)
