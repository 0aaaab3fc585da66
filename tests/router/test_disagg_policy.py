"""Conditional disaggregation: the decider (router/core/disagg_policy.py) on hand-built cases,
the case the router reads from its routing state (router/core/disagg_state.py), the latency
model file (common/latency_model.py) and the config's checks."""
from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.common.config import ConfigError
from pdserve.common.hashing import block_hashes
from pdserve.common.wire.messages import WorkerHello
from pdserve.router.core.config import RouterConfig
from pdserve.router.core.disagg_policy import DisaggCase, DisaggPolicy
from pdserve.router.core.disagg_state import disagg_case, policy_from_config
from pdserve.common.latency_model import Curve, DecodeFit, LatencyModel
from pdserve.router.core.registry import WorkerEntry
from pdserve.router.core.requests import InFlight

BLOCK = 16


def case(uncached_d: int = 100, uncached_p: int | None = None, blocks: int | None = None, p_queue: int = 0,
         d_queue: int = 0, batch: int = 0, context: float = 0.0, prompt: int | None = None) -> DisaggCase:
    prompt = prompt or uncached_d
    return DisaggCase(prompt, uncached_d, uncached_d if uncached_p is None else uncached_p,
                      -(-uncached_d // BLOCK) if blocks is None else blocks, p_queue, d_queue, batch, context)


# prefill: 1 ms per token past a 10 ms floor (10 ms at 0, 110 ms at 100, 1.01 s at 1000)
# decode step: 5 ms + 1 ms per sequence + 1 us per context token; transfer: 2 ms + 1 ms per block
MODEL = LatencyModel(Curve(((0.0, 0.010), (1000.0, 1.010))), DecodeFit(0.005, 0.001, 1e-6),
                     Curve(((1.0, 0.003), (64.0, 0.066))))


# ---- always / never / threshold ---------------------------------------------------------

def test_always_and_never_ignore_the_case():
    for c in (case(1), case(5000, p_queue=10**6, batch=50)):
        assert DisaggPolicy("always").decide(c).disaggregate
        assert DisaggPolicy("always").decide(c).reason == "always"
        assert not DisaggPolicy("never").decide(c).disaggregate


def test_threshold_splits_at_the_uncached_part_on_d():
    pol = DisaggPolicy("threshold", threshold_tokens=64)
    short, at, cached_long = pol.decide(case(63)), pol.decide(case(64)), pol.decide(case(10, prompt=1000))
    assert (short.disaggregate, short.reason, short.prefill_tokens) == (False, "short_prompt", 63)
    assert (at.disaggregate, at.reason, at.prefill_tokens) == (True, "long_prompt", 64)
    # a long prompt whose prefix D holds: only its uncached part counts
    assert (cached_long.disaggregate, cached_long.reason) == (False, "short_prompt")


def test_threshold_prefills_on_d_when_the_prefill_queue_is_long():
    pol = DisaggPolicy("threshold", threshold_tokens=64, max_prefill_queue_tokens=2000)
    assert pol.decide(case(500, p_queue=2000)).disaggregate  # at the limit: still via P
    over = pol.decide(case(500, p_queue=2001))
    assert (over.disaggregate, over.reason, over.prefill_tokens) == (False, "prefill_queue", 500)
    assert DisaggPolicy("threshold", threshold_tokens=64).decide(case(500, p_queue=10**6)).disaggregate  # 0: no limit


def test_prefill_tokens_is_what_the_chosen_worker_computes():
    pol = DisaggPolicy("threshold", threshold_tokens=64)
    d = pol.decide(case(uncached_d=200, uncached_p=40))  # P holds more of the prefix than D
    assert d.disaggregate and d.prefill_tokens == 40


# ---- cost ----------------------------------------------------------------------------------

def test_cost_idle_pair_prefills_short_prompts_on_d_and_long_ones_via_p():
    pol = DisaggPolicy("cost", model=MODEL)
    short = pol.decide(case(20))    # via P: 30 ms + transfer 4 ms; on D: 30 ms
    long = pol.decide(case(1000))   # a long prompt costs both the same prefill, P adds transfer: on D
    assert (short.disaggregate, short.reason) == (False, "cost")
    assert short.ttft_via_prefill_s == pytest.approx(0.030 + 0.004) and short.ttft_on_decode_s == pytest.approx(0.030)
    assert not long.disaggregate  # nothing runs on D: nothing argues for P


def test_cost_counts_the_decode_step_d_shares():
    # D decodes 32 sequences of 1000 tokens: a step of 5 + 32 + 32 ms = 69 ms rides on the local prefill
    pol = DisaggPolicy("cost", model=MODEL)
    got = pol.decide(case(100, batch=32, context=1000.0))
    assert got.ttft_on_decode_s == pytest.approx(0.110 + 0.069)
    assert got.ttft_via_prefill_s == pytest.approx(0.110 + 0.009)
    assert (got.disaggregate, got.reason) == (True, "cost")


def test_cost_a_long_prefill_queue_sends_the_prompt_to_d():
    pol = DisaggPolicy("cost", model=MODEL)
    got = pol.decide(case(100, p_queue=900, batch=4, context=100.0))
    assert got.ttft_via_prefill_s == pytest.approx(1.010 + 0.009)   # P's queue computes first
    assert got.ttft_on_decode_s == pytest.approx(0.110 + 0.0094)
    assert not got.disaggregate and got.reason == "cost"


def test_cost_d_local_queue_counts_too():
    pol = DisaggPolicy("cost", model=MODEL)
    assert pol.decide(case(100, d_queue=900)).disaggregate  # D already prefills 900 tokens locally


def test_tpot_guard_keeps_long_prefills_off_a_busy_d():
    busy = case(100, p_queue=900, batch=4, context=100.0)  # D wins on TTFT (see above)
    loose = DisaggPolicy("cost", tpot_guard_s=0.2, model=MODEL).decide(busy)  # step 9.4 ms + prefill 110 ms < 200 ms
    tight = DisaggPolicy("cost", tpot_guard_s=0.1, model=MODEL).decide(busy)
    assert not loose.disaggregate
    assert (tight.disaggregate, tight.reason) == (True, "tpot_guard")
    # with no decodes on D there is nothing to guard
    assert not DisaggPolicy("cost", tpot_guard_s=0.001, model=MODEL).decide(case(100, p_queue=900)).disaggregate


def test_policy_refuses_incomplete_rules():
    with pytest.raises(ValueError, match="one of"):
        DisaggPolicy("sometimes")
    with pytest.raises(ValueError, match="latency model"):
        DisaggPolicy("cost")
    with pytest.raises(ValueError, match=">= 0"):
        DisaggPolicy("threshold", threshold_tokens=-1)


# ---- the case the router reads ---------------------------------------------------------------

def entry(wid: str, role: str) -> WorkerEntry:
    return WorkerEntry(WorkerHello(wid, role, f"tcp://127.0.0.1:{7000 + len(wid)}", "cpu", 64, BLOCK, "fp"), 0.0)


def flight(rid: str, decode: WorkerEntry, prefill: WorkerEntry | None, prompt: int, prefill_tokens: int,
           outputs: int = 0) -> InFlight:
    from pdserve.router.core.disagg_policy import Decision
    r = InFlight(rid, asyncio.Queue(), decode, prefill, None, prompt, 0.0,  # type: ignore[arg-type]
                 route=Decision(prefill is not None, "test", prefill_tokens))
    if outputs:
        r.first_token_at, r.num_output_tokens = 1.0, outputs
    return r


def test_case_from_prefix_indexes_and_requests_in_flight():
    d, p, other_d = entry("d0", "decode"), entry("p0", "prefill"), entry("d1", "decode")
    ids = list(range(100, 200))  # 100 tokens: 6 full blocks, 7 in all
    hashes = block_hashes(ids, BLOCK)[:(len(ids) - 1) // BLOCK]
    d.cached.update(hashes[:2])  # D holds 2 leading blocks
    p.cached.update(hashes[:5])  # P holds 5
    p.cached.add(hashes[5])
    inflight = [flight("a", d, p, 300, 250),            # queued at P
                flight("b", d, None, 40, 30),           # prefilling on D
                flight("c", d, p, 500, 400, outputs=9),  # decoding on D
                flight("e", d, None, 90, 90, outputs=1),  # decoding on D (was local)
                flight("f", other_d, p, 70, 70),        # queued at P for another D
                flight("g", other_d, None, 60, 60, outputs=3)]  # another D's batch
    c = disagg_case(len(ids), hashes, d, p, inflight, BLOCK)
    assert c == DisaggCase(prompt_tokens=100, uncached_on_decode=100 - 32, uncached_on_prefill=100 - 96,
                           transfer_blocks=7 - 2, prefill_queue_tokens=250 + 70, local_queue_tokens=30,
                           decode_batch=2, decode_context=(509 + 91) / 2)


def test_case_with_nothing_cached_or_running():
    d, p = entry("d0", "decode"), entry("p0", "prefill")
    c = disagg_case(33, block_hashes(list(range(33)), BLOCK)[:2], d, p, [], BLOCK)
    assert (c.uncached_on_decode, c.uncached_on_prefill, c.transfer_blocks) == (33, 33, 3)
    assert (c.prefill_queue_tokens, c.local_queue_tokens, c.decode_batch, c.decode_context) == (0, 0, 0, 0.0)


# ---- the latency model file and the config ---------------------------------------------------

def test_curve_interpolates_and_extends():
    c = Curve(((16.0, 0.02), (64.0, 0.05), (256.0, 0.11)))
    assert c(16) == pytest.approx(0.02) and c(40) == pytest.approx(0.035) and c(160) == pytest.approx(0.08)
    assert c(512) == pytest.approx(0.11 + 256 * 0.06 / 192)  # past the end: its last segment
    assert c(0) == pytest.approx(0.02 - 16 * 0.03 / 48) and c(-10**6) == 0.0
    with pytest.raises(ValueError, match="increasing"):
        Curve(((1.0, 0.1), (1.0, 0.2)))


def test_decode_fit_recovers_a_linear_step():
    true = DecodeFit(0.004, 0.0005, 2e-7)
    samples = [(b, c, true(b, c)) for b in (1, 4, 16) for c in (64.0, 512.0)]
    got = DecodeFit.fit(samples)
    assert got.base_s == pytest.approx(0.004) and got.per_seq_s == pytest.approx(0.0005)
    assert got.per_token_s == pytest.approx(2e-7)
    assert DecodeFit.fit([(1, 10.0, 0.01), (2, 10.0, 0.005)]).per_seq_s == 0.0  # never negative


def test_latency_model_round_trips_and_bad_files_are_named(tmp_path):
    path = tmp_path / "lm.json"
    MODEL.save(path)
    assert LatencyModel.load(path).to_json() == MODEL.to_json()
    bad = MODEL.to_json()
    bad["transfer"]["points"] = [[1, -0.5], [2, 0.1]]
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="transfer seconds"):
        LatencyModel.load(path)
    path.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ConfigError, match="schema"):
        LatencyModel.load(path)
    with pytest.raises(ConfigError, match="cannot read"):
        LatencyModel.load(tmp_path / "missing.json")


def test_router_config_checks_and_builds_the_policy(tmp_path):
    with pytest.raises(ConfigError, match="disagg 'maybe'"):
        RouterConfig(model_dir="m", disagg="maybe")
    with pytest.raises(ConfigError, match="disagg_latency_model"):
        RouterConfig(model_dir="m", disagg="cost")
    with pytest.raises(ConfigError, match=">= 0"):
        RouterConfig(model_dir="m", disagg="threshold", disagg_max_prefill_queue=-1)
    assert policy_from_config(RouterConfig(model_dir="m")).mode == "always"  # today's behaviour by default
    MODEL.save(tmp_path / "lm.json")
    pol = policy_from_config(RouterConfig(model_dir="m", disagg="cost", disagg_latency_model=str(tmp_path / "lm.json"),
                                          disagg_tpot_guard_ms=50))
    assert pol.model is not None and pol.tpot_guard_s == pytest.approx(0.05)
    with pytest.raises(ConfigError, match="cannot read"):
        policy_from_config(RouterConfig(model_dir="m", disagg="cost", disagg_latency_model=str(tmp_path / "no.json")))


def test_router_side_counts_stamps_and_feeds_d_prefix_index():
    from prometheus_client import generate_latest

    from pdserve.router.core.disagg_state import Disaggregation
    from pdserve.router.core.metrics import RouterMetrics
    metrics = RouterMetrics()
    dis = Disaggregation(RouterConfig(model_dir="m", disagg="threshold", disagg_threshold_tokens=40), metrics)
    d, p = entry("d0", "decode"), entry("p0", "prefill")
    ids = list(range(100, 150))  # 50 tokens: 3 full blocks, all matchable (49 // 16)
    hashes = block_hashes(ids, BLOCK)[:3]
    first = dis.decide(len(ids), hashes, d, p, [])
    assert first.disaggregate and first.reason == "long_prompt"
    assert set(hashes) <= d.cached  # D holds the prompt's KV after either path
    again = dis.decide(len(ids) + 4, hashes, d, p, [])  # the same prefix again: D lacks 54 - 48 tokens
    assert not again.disaggregate and again.reason == "short_prompt" and again.prefill_tokens == 6
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve_disagg_decisions_total{decision="disagg",reason="long_prompt"} 1.0' in text
    assert 'pdserve_disagg_decisions_total{decision="local",reason="short_prompt"} 1.0' in text
    timeline: dict[str, float] = {}
    dis.mark(timeline, again, 5.0)
    assert timeline == {"route_local": 5.0}
    always = Disaggregation(RouterConfig(model_dir="m"), RouterMetrics())
    timeline = {}
    always.mark(timeline, always.decide(len(ids), hashes, d, p, []), 5.0)
    assert timeline == {}  # the default mode leaves the timeline as it always was
