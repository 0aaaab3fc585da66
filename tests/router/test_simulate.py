"""`pdserve simulate`: a schedule computed by hand, the real engine and router code in the
loop, the CLI's bench-shaped JSON and the split search."""
from __future__ import annotations

import json

import pytest

from pdserve.common.config import SchedulerConfig
from pdserve.router.cli import main as cli
from pdserve.router.core.config import RouterConfig
from pdserve.common.latency_model import Curve, DecodeFit, LatencyModel
from pdserve.router.simulate.sim import Deployment, Simulation

BLOCK = 16


def _model(tmp_path=None) -> LatencyModel:
    """Prefill 100 ms a step whatever its tokens, decode 10 ms a step whatever its batch,
    transfer 12 ms for 1 block and 27 ms for 2 (15 ms a block beyond)."""
    m = LatencyModel(Curve(((1, 0.1), (100_000, 0.1))), DecodeFit(0.01, 0.0, 0.0), Curve(((1, 0.012), (2, 0.027))),
                     {"block_size": BLOCK})
    if tmp_path is not None:
        m.save(tmp_path / "lm.json")
    return m


def _sim(dep: Deployment, disagg: str = "always", path: str = "") -> Simulation:
    cfg = RouterConfig(model_dir="simulated", disagg=disagg, block_size=BLOCK, disagg_latency_model=path)
    return Simulation(dep, _model(), cfg)


def test_hand_computed_schedule_1p1d():
    # A (t=0, 16 tokens = 1 block, 15 out) and B (t=0.05, 32 tokens = 2 blocks, 3 out), 1P+1D:
    # P: A [0, .1], B [.1, .2] (B waits for P). A's KV lands .1 + .012 = .112 (first token);
    # D then steps every 10 ms: A's tokens at .112 + .01k, the last (15th) at .252.
    # B's KV lands .2 + .027 = .227, mid-step [.222, .232]; B decodes from the step at .232:
    # its tokens at .227, .242, .252.
    sim = _sim(Deployment(1, 1))
    reqs = sim.run([(0.0, list(range(100, 116)), 15), (0.05, list(range(200, 232)), 3)])
    a, b = (r.record for r in reqs)
    assert a.token_times == pytest.approx([0.112 + 0.01 * k for k in range(15)], abs=1e-9)
    assert b.token_times == pytest.approx([0.227, 0.242, 0.252], abs=1e-9)
    assert a.ttft == pytest.approx(0.112, abs=1e-9) and a.tpot == pytest.approx(0.01, abs=1e-9)
    assert b.ttft == pytest.approx(0.177, abs=1e-9) and b.tpot == pytest.approx(0.0125, abs=1e-9)
    assert reqs[1].timeline["prefill_start"] == pytest.approx(0.1)
    assert not sim.router.inflight and all(e.inflight == 0 for e in sim.router.registry.workers.values())
    for w in sim.workers.values():
        assert w.block_manager.num_free_blocks == w.block_manager.num_blocks


def test_a_shared_first_block_spreads_prompts_over_the_prefill_workers():
    # 2P+1D; three prompts of 5 blocks sharing only their first (a system prompt), sent 10 ms
    # apart, each prefilled in 100 ms. A goes to either P. B: A's P has A's 5 blocks queued
    # and saves B 1 block, the other P nothing queued, so B goes there and starts at once.
    # C: both Ps cost 5 - 1 = 4 blocks and hold one request each; it waits for a P (.1).
    sim = _sim(Deployment(2, 1))
    system = list(range(1, 1 + BLOCK))
    reqs = sim.run([(0.01 * k, system + list(range(100 * (k + 1), 100 * (k + 1) + 4 * BLOCK)), 2)
                    for k in range(3)])
    a, b, c = reqs
    assert a.prefill.worker_id != b.prefill.worker_id
    assert [r.timeline["prefill_start"] for r in reqs] == pytest.approx([0.0, 0.01, 0.1])
    assert sim.router._queued_blocks() == {} and all(e.inflight == 0 for e in sim.router.registry.workers.values())


def test_colocated_prefix_cache_hit_is_the_block_managers():
    # One colocated worker; the second prompt repeats the first's 2 full blocks. Both prefill
    # in 100 ms, but the block manager serves the repeat's cached blocks (seen in its seq).
    sim = _sim(Deployment(0, 0, 1))
    ids = list(range(300, 333))  # 33 tokens: 2 cacheable blocks
    reqs = sim.run([(0.0, ids, 2), (1.0, ids, 2)])
    assert [r.record.ttft for r in reqs] == pytest.approx([0.1, 0.1])
    assert reqs[1].d_seq.num_cached_tokens == 2 * BLOCK and reqs[0].d_seq.num_cached_tokens == 0
    w = sim.workers["colocated-0"]
    assert w.block_manager.num_free_blocks == w.block_manager.num_blocks  # nothing leaks
    w.block_manager.check_invariants()


def test_the_engine_and_router_code_is_in_the_loop(monkeypatch):
    # The router's disaggregation decides: forced local, P never steps and D prefills.
    from pdserve.router.core.disagg_policy import Decision, DisaggPolicy
    monkeypatch.setattr(DisaggPolicy, "decide", lambda self, case: Decision(False, "test", case.uncached_on_decode))
    calls = []
    from pdserve.common.engine.scheduler import Scheduler
    real = Scheduler.schedule
    monkeypatch.setattr(Scheduler, "schedule", lambda self: calls.append(self) or real(self))
    sim = _sim(Deployment(1, 1))
    reqs = sim.run([(0.0, list(range(100, 116)), 3)])
    assert sim.workers["prefill-0"].steps == 0 and sim.workers["decode-0"].steps == 3
    assert reqs[0].record.token_times == pytest.approx([0.1, 0.11, 0.12])  # local prefill: no transfer
    assert calls and all(s is sim.workers["decode-0"].scheduler for s in calls)


def test_decode_cache_too_small_preempts_and_recovers():
    # 2 decode sequences needing 3 blocks each at the end on a 5-block decode worker.
    dep = Deployment(1, 1, num_blocks=5, scheduler=SchedulerConfig(max_num_seqs=4))
    sim = _sim(dep)
    reqs = sim.run([(0.0, list(range(100, 116)), 20), (0.0, list(range(200, 216)), 20)])
    assert all(r.record.output_len == 20 for r in reqs)
    for w in sim.workers.values():
        assert w.block_manager.num_free_blocks == 5
        w.block_manager.check_invariants()


def _trace(tmp_path):
    rows = [{"timestamp": i * 200, "input_length": 512 * (1 + i % 3), "output_length": 64,
             "hash_ids": [0] + [1000 + i * 4 + k for k in range(i % 3)]} for i in range(30)]
    p = tmp_path / "trace.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_cli_writes_bench_shaped_json_and_plots(tmp_path):
    _model(tmp_path)
    out = tmp_path / "sim.json"
    rc = cli.main(["simulate", "--trace", str(_trace(tmp_path)), "--latency-model", str(tmp_path / "lm.json"),
                   "--prefill", "1", "--decode", "2", "--duration-s", "4", "--slo-ttft-ms", "500",
                   "--slo-tpot-ms", "20", "--out", str(out), "--plot-dir", str(tmp_path / "plots")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["completed"] == res["num_prompts"] == 20 and res["failed"] == 0
    for key in ("request_goodput", "slo_attainment", "median_ttft_ms", "p90_ttft_ms", "p99_tpot_ms", "mean_itl_ms",
                "request_rate", "duration", "config"):
        assert key in res
    assert res["deployment"] == "1P+2D" and res["simulator"]["steps"] > 0
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0
    assert (tmp_path / "plots" / "timelines.png").stat().st_size > 0


def test_search_returns_a_split(tmp_path):
    _model(tmp_path)
    out = tmp_path / "search.json"
    rc = cli.main(["simulate", "--trace", str(_trace(tmp_path)), "--latency-model", str(tmp_path / "lm.json"),
                   "--search", "--workers", "3", "--search-disagg", "always,never", "--duration-s", "2",
                   "--slo-ttft-ms", "300", "--slo-tpot-ms", "20", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    labels = {(c["deployment"], c["disagg"]) for c in res["candidates"]}
    assert labels == {("1P+2D", "always"), ("1P+2D", "never"), ("2P+1D", "always"), ("2P+1D", "never"),
                      ("3C", "always")}
    best = res["best"]
    assert best == max(res["candidates"], key=lambda c: (c["goodput_per_worker"], c["slo_attainment"]))


def test_bad_deployment_is_refused(tmp_path, capsys):
    _model(tmp_path)
    rc = cli.main(["simulate", "--trace", str(_trace(tmp_path)), "--latency-model", str(tmp_path / "lm.json"),
                   "--prefill", "0", "--decode", "1", "--out", str(tmp_path / "x.json")])
    assert rc != 0 and not (tmp_path / "x.json").exists()
    assert "prefill and a decode worker" in capsys.readouterr().err


def test_workers_sharing_cores_share_them_while_both_step():
    # 2P+1D on 1 core, 1 thread each; A (t=0) and B (t=.05), 1 block and 1 token out each
    # (no decode steps), go to the two P workers. A steps alone at full speed for .05
    # (.05 of its .1 done); from .05 A and B share the core at half speed: A's last .05
    # takes .1 and ends at .15, when B has done .05; B's last .05 runs alone, ending .2.
    # KV lands .012 later: A's first token .162, B's .212 (TTFT .162 each). Without
    # host_cores each prefill takes .1: TTFT .112.
    ids_a, ids_b = list(range(100, 116)), list(range(200, 216))
    sim = _sim(Deployment(2, 1, host_cores=1))
    a, b = sim.run([(0.0, ids_a, 1), (0.05, ids_b, 1)])
    assert a.prefill.worker_id != b.prefill.worker_id
    assert [a.timeline["prefill_end"], b.timeline["prefill_end"]] == pytest.approx([0.15, 0.2], abs=1e-9)
    assert [a.record.ttft, b.record.ttft] == pytest.approx([0.162, 0.162], abs=1e-9)
    for w in sim.workers.values():
        assert w.block_manager.num_free_blocks == w.block_manager.num_blocks and not w.busy
    a, b = _sim(Deployment(2, 1)).run([(0.0, ids_a, 1), (0.05, ids_b, 1)])
    assert [a.record.ttft, b.record.ttft] == pytest.approx([0.112, 0.112], abs=1e-9)


def test_a_decode_step_beside_a_prefill_shares_the_core():
    # 1P+1D on 1 core; A (t=0, 1 block, 3 out) prefills alone [0, .1], its KV lands .112
    # (first token) and D decodes alone: .122, .132. B (t=.115) starts its prefill while
    # D's first step runs: from .115 both go at half speed. D's step [.112, ...]: .003
    # alone, its last .007 at half speed: ends .129; P has done .007 of B by then.
    # D's second step starts .129 beside P: .01 at half speed, ends .149 (A's third token);
    # P has done .007 + .01 = .017 of B; alone from .149, B's last .083 ends .232, its KV
    # lands .244.
    sim = _sim(Deployment(1, 1, host_cores=1))
    a, b = sim.run([(0.0, list(range(100, 116)), 3), (0.115, list(range(200, 216)), 1)])
    assert a.record.token_times == pytest.approx([0.112, 0.129, 0.149], abs=1e-9)
    assert b.timeline["prefill_end"] == pytest.approx(0.232, abs=1e-9)
    assert b.record.token_times == pytest.approx([0.244], abs=1e-9)


def test_threads_within_the_cores_do_not_stretch():
    # One colocated worker of 2 threads on 2 cores: x1, as if it had the host to itself.
    (r,) = _sim(Deployment(0, 0, 1, threads=2, host_cores=2)).run([(0.0, list(range(100, 116)), 2)])
    assert r.record.token_times == pytest.approx([0.1, 0.11], abs=1e-9)
    with pytest.raises(ValueError, match="threads"):
        Deployment(1, 1, threads=0)


def test_host_cpu_per_token_takes_from_steps_only_where_the_threads_fill_the_cores():
    # One colocated worker of 2 threads on 2 cores, the router's 5 ms a token: the prefill
    # step streams the first token (.1 + .005), the decode step the second (.01 + .005).
    ids = list(range(100, 116))
    (r,) = _sim(Deployment(0, 0, 1, threads=2, host_cores=2, host_cpu_per_token_s=0.005)).run([(0.0, ids, 2)])
    assert r.record.token_times == pytest.approx([0.105, 0.12], abs=1e-9)
    # 1P+1D, 1 thread each on 2 cores: D decodes while P is idle, a core is free for the
    # router; P's prefill ran alone too. Token times as without it: KV lands .112, then a
    # 10 ms step a token.
    (r,) = _sim(Deployment(1, 1, threads=1, host_cores=2, host_cpu_per_token_s=0.005)).run([(0.0, ids, 3)])
    assert r.record.token_times == pytest.approx([0.112, 0.122, 0.132], abs=1e-9)
    # on one core P's prefill fills it: its sampled token adds .005 (KV lands .117), and
    # so does each decode step on D (.015 a step)
    (r,) = _sim(Deployment(1, 1, threads=1, host_cores=1, host_cpu_per_token_s=0.005)).run([(0.0, ids, 3)])
    assert r.record.token_times == pytest.approx([0.117, 0.132, 0.147], abs=1e-9)
    with pytest.raises(ValueError, match="host_cpu_per_token_s"):
        Deployment(1, 1, host_cpu_per_token_s=-0.001)


def test_host_cpu_is_shared_by_the_workers_stepping_when_a_step_streams():
    # 1P+1D, 1 thread each on 2 cores, the router's 10 ms a token. A (t=0, 1 block, 3 out)
    # prefills alone (a core free: no charge), its KV lands .112 and D's first step
    # [.112, .122] starts alone. B (t=.115, 1 out) starts its prefill beside it: the cores
    # are full, and the token B's step samples costs 10 ms, 5 to each stepping worker:
    # D's step ends .127, P's at .115 + .1 + .005. D's second step (.127, beside P) streams
    # A's third token: 5 ms to D (ends .142) and 5 to P (ends .225); B's KV lands .237.
    sim = _sim(Deployment(1, 1, threads=1, host_cores=2, host_cpu_per_token_s=0.01))
    a, b = sim.run([(0.0, list(range(100, 116)), 3), (0.115, list(range(200, 216)), 1)])
    assert a.record.token_times == pytest.approx([0.112, 0.127, 0.142], abs=1e-9)
    assert b.timeline["prefill_end"] == pytest.approx(0.225, abs=1e-9)
    assert b.record.token_times == pytest.approx([0.237], abs=1e-9)


def test_cli_host_cores_stretch_the_run(tmp_path):
    _model(tmp_path)
    # 2 threads a worker on 1 core: every step takes at least twice its time, more while
    # D's steps share the core with a prefill: the median request's prefill 100 -> >= 200
    # ms, its transfer (no step) 12 ms either way
    ttft = []
    for flags in ([], ["--threads", "2", "--host-cores", "1"]):
        out = tmp_path / f"sim{len(flags)}.json"
        rc = cli.main(["simulate", "--trace", str(_trace(tmp_path)), "--latency-model", str(tmp_path / "lm.json"),
                       "--prefill", "1", "--decode", "2", "--duration-s", "4", "--out", str(out), *flags])
        assert rc == 0
        ttft.append(json.loads(out.read_text())["median_ttft_ms"])
    assert ttft[0] == pytest.approx(112.0) and ttft[1] >= 212.0 - 1e-6
    rc = cli.main(["simulate", "--trace", str(_trace(tmp_path)), "--latency-model", str(tmp_path / "lm.json"),
                   "--threads", "0", "--out", str(tmp_path / "x.json")])
    assert rc != 0 and not (tmp_path / "x.json").exists()


def test_a_step_of_several_prompts_prices_each_and_its_fixed_cost_once():
    # C (16 tokens) at t=0 holds the colocated worker; A and B arrive during its step and
    # share the next. Prefill curve 20 ms + 1 ms/token (fixed cost 20 ms): C [0, .036];
    # A (16) + B (32) together 20 + 16 + 32 = 68 ms: both first tokens at .104.
    m = LatencyModel(Curve(((16, 0.036), (32, 0.052))), DecodeFit(0.01, 0.0, 0.0), Curve(((1, 0.0), (2, 0.0))))
    sim = Simulation(Deployment(0, 0, 1), m, RouterConfig(model_dir="simulated", block_size=BLOCK))
    c, a, b = sim.run([(0.0, list(range(300, 316)), 1), (0.001, list(range(100, 116)), 1),
                       (0.001, list(range(200, 232)), 1)])
    assert [r.record.token_times[0] for r in (c, a, b)] == pytest.approx([0.036, 0.104, 0.104])
    # superlinear curve (0: 0 s, 16: 16 ms, 32: 48 ms): A and B of 16 tokens each share a
    # step of 32 ms, not the 48 ms of one 32-token prompt: both at .016 + .032 = .048
    m = LatencyModel(Curve(((0, 0.0), (16, 0.016), (32, 0.048))), DecodeFit(0.01, 0.0, 0.0),
                     Curve(((1, 0.0), (2, 0.0))))
    sim = Simulation(Deployment(0, 0, 1), m, RouterConfig(model_dir="simulated", block_size=BLOCK))
    c, a, b = sim.run([(0.0, list(range(300, 316)), 1), (0.001, list(range(100, 116)), 1),
                       (0.001, list(range(200, 216)), 1)])
    assert [r.record.token_times[0] for r in (c, a, b)] == pytest.approx([0.016, 0.048, 0.048])


def test_decode_rows_beside_a_prompt_chunk_do_not_pay_the_weights_again():
    # One colocated worker; prefill 100 ms a step, decode 10 ms + 2 ms a sequence. A (t=0,
    # 4 out): prefill [0, .1], decode [.1, .112]. B arrives at .105 and shares the next step
    # with A's decode row: .1 + (.012 - .01) = .102, so A's 3rd and B's 1st token at .214
    # (not .224: the decode fit's 10 ms base is the weights' stream, paid once a step). Then
    # both decode (.014): .228; B alone (.012): .240, .252.
    m = LatencyModel(Curve(((1, 0.1), (100_000, 0.1))), DecodeFit(0.01, 0.002, 0.0), Curve(((1, 0.0), (2, 0.0))))
    sim = Simulation(Deployment(0, 0, 1), m, RouterConfig(model_dir="simulated", block_size=BLOCK))
    a, b = sim.run([(0.0, list(range(100, 116)), 4), (0.105, list(range(200, 216)), 4)])
    assert a.record.token_times == pytest.approx([0.1, 0.112, 0.214, 0.228], abs=1e-9)
    assert b.record.token_times == pytest.approx([0.214, 0.228, 0.240, 0.252], abs=1e-9)
