"""The SLO planner in a real deployment (docs/slo.md "Planner"): `pdserve serve
--prefill 1 --decode 1 --planner slo` with a TTFT SLO no request can meet and a stream of
long prompts with short outputs. The only decode worker cannot be spared, so the planner
adds a prefill worker (up to --planner-max-workers 3) and then holds still at that size;
the new worker serves, every request completes with transformers' greedy output, the
decision is in /metrics, and blocks are back to baseline. And on one host, a colocated
worker is split into 1P + 1D on one core each when TPOT is out of reach; and with no new
workers allowed, a spare decode worker is re-roled to prefill."""
from __future__ import annotations

import contextlib
import re
import threading
import time
import urllib.request
from typing import Iterator

from tests.support.reliability_harness import complete, health, recoveries, serve, stop, wait_blocks_baseline

MAX_NEW = 3
STREAMS = 2
PAUSE_S = 0.1  # between a client's requests: enough to keep TTFT over its SLO, few to check against transformers
PLANNER = ["--planner", "slo", "--slo-ttft-ms", "1", "--slo-tpot-ms", "100000", "--planner-interval-s", "0.5",
           "--planner-sustain", "2", "--planner-cooldown-s", "1", "--planner-max-workers", "3"]


@contextlib.contextmanager
def streaming(served, tok, prompts) -> Iterator[list]:
    """STREAMS clients sending prompt-heavy requests (~100 prompt tokens, 3 out, each its
    own first block so no prefix cache ties them to one worker) until the block ends;
    yields the list their (prompt ids, result) pairs are appended to."""
    body = [t for p in prompts for t in p][:100]
    results: list = []
    halt = threading.Event()

    def client(offset: int) -> None:
        i = offset
        while not halt.is_set():
            ids = tok.encode(f"Request {i}:") + body
            try:
                results.append((ids, complete(served, ids, MAX_NEW, timeout=60)))
            except Exception as e:  # an HTTP error is a failed request: recorded, checked below
                results.append((ids, {"token_ids": [], "error": f"{type(e).__name__}: {e}"}))
            i += STREAMS
            halt.wait(PAUSE_S)

    clients = [threading.Thread(target=client, args=(k,)) for k in range(STREAMS)]
    for c in clients:
        c.start()
    try:
        yield results
    finally:
        halt.set()
        for c in clients:
            c.join(120)


def check_outputs(served, results: list, greedy) -> None:
    """Every request completed, with transformers' greedy output, none re-routed."""
    assert results, "the stream did not run"
    for ids, res in results:
        assert res["error"] is None, res
        assert res["token_ids"] == greedy(ids, MAX_NEW)
    assert recoveries(served) == {}


def _wait_for(cond, what: str, served, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while not (h := health(served)) or not cond(h):
        assert time.monotonic() < deadline, f"{what}:\n{h}\n{served.log_tail()}"
        time.sleep(0.2)
    return h


def _wait_metrics(served, pattern: str, timeout: float = 60) -> str:
    """/metrics once a line matches `pattern`."""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, text := urllib.request.urlopen(served.base + "/metrics", timeout=10).read().decode(),
                        re.M):
        assert time.monotonic() < deadline, f"{pattern} not in /metrics:\n{text}\n{served.log_tail()}"
        time.sleep(0.2)
    return text


def test_planner_adds_a_prefill_worker_for_a_ttft_bound_stream(tmp_path, tok, prompts, greedy):
    served = serve(tmp_path, ["--prefill", "1", "--decode", "1"], extra=tuple(PLANNER))
    try:
        with streaming(served, tok, prompts) as results:
            h = _wait_for(lambda h: sum(v["role"] == "prefill" and v["state"] == "serving"
                                        for v in h["pools"].values()) == 2, "no second prefill worker", served)
            (new,) = [w for w, v in h["pools"].items() if v["role"] == "prefill" and w != "prefill-0"]
            _wait_for(lambda h: h["pools"][new]["routed"] > 0, f"{new} served nothing", served)
            # windows at the maximum size, once they judge --planner-min-requests of its own: it holds still
            text = _wait_metrics(served, r'^pdserve_planner_decisions_total\{action="none",'
                                         r'reason="ttft_low_at_max_workers"\} [1-9]')
        check_outputs(served, results, greedy)
        h = health(served)
        assert h["workers"] == {"prefill": 2, "decode": 1, "colocated": 0}, h
        assert re.search(r'^pdserve_planner_decisions_total\{action="add",reason="ttft_low"\} 1\.0$', text, re.M), text
        assert re.search(r"^pdserve_planner_ttft_attainment 0\.0$", text, re.M), text
        assert "planner: add 1 prefill worker(s) (ttft_low): " in served.log.read_text(errors="replace")
        wait_blocks_baseline(served, ["prefill-0", new, "decode-0"])
    finally:
        stop(served)


def test_planner_re_roles_a_spare_decode_worker_to_prefill(tmp_path, tok, prompts, greedy):
    """No new workers allowed (--planner-max-workers 0): a decode worker with slack is
    drained and restarted as a prefill worker under the same id; no request is lost."""
    roles = [a for a in PLANNER if a != "--planner-max-workers" and a != "3"]
    served = serve(tmp_path, ["--prefill", "1", "--decode", "2"], extra=tuple(roles))
    try:
        with streaming(served, tok, prompts) as results:
            h = _wait_for(lambda h: h["workers"] == {"prefill": 2, "decode": 1, "colocated": 0},
                          "no decode worker re-roled", served, timeout=90)
            (moved,) = [w for w, v in h["pools"].items() if v["role"] == "prefill" and w.startswith("decode-")]
            _wait_for(lambda h: h["pools"][moved]["routed"] > 0, f"{moved} served nothing as prefill", served)
            time.sleep(1.0)
            text = urllib.request.urlopen(served.base + "/metrics", timeout=10).read().decode()
        check_outputs(served, results, greedy)
        assert re.search(r'^pdserve_planner_decisions_total\{action="re_role",reason="ttft_low"\} 1\.0$', text,
                         re.M), text
        assert re.search(rf"decode worker {moved} left its pool \(exit code 0\)", served.log.read_text()), moved
        (kept,) = [w for w, v in health(served)["pools"].items() if v["role"] == "decode"]
        wait_blocks_baseline(served, ["prefill-0", moved, kept])
    finally:
        stop(served)


def test_planner_splits_a_colocated_worker_into_p_and_d_on_one_core_each(tmp_path, tok, prompts, greedy):
    """One host, two cores: a TPOT SLO no request meets under colocation makes the planner
    start 1P + 1D with one thread each, then drain the colocated worker (exit code 0)."""
    split = [a for a in PLANNER if a != "--planner-max-workers" and a != "3"]
    split[split.index("--slo-ttft-ms") + 1], split[split.index("--slo-tpot-ms") + 1] = "100000", "0.001"
    served = serve(tmp_path, ["--colocated", "1"], extra=(*split, "--planner-host-cores", "2"))
    try:
        with streaming(served, tok, prompts) as results:
            h = _wait_for(lambda h: h["workers"] == {"prefill": 1, "decode": 1, "colocated": 0} and
                          "colocated-0" not in h["pools"], "no split into 1P + 1D", served, timeout=90)
            (p,) = [w for w, v in h["pools"].items() if v["role"] == "prefill"]
            (d,) = [w for w, v in h["pools"].items() if v["role"] == "decode"]
            _wait_for(lambda h: h["pools"][p]["routed"] > 0 and h["pools"][d]["routed"] > 0, "P/D serve nothing",
                      served)
            time.sleep(1.5)
            text = urllib.request.urlopen(served.base + "/metrics", timeout=10).read().decode()
        check_outputs(served, results, greedy)
        assert re.search(r'^pdserve_planner_decisions_total\{action="split",reason="tpot_interference"\} 1\.0$',
                         text, re.M), text
        log = served.log.read_text(errors="replace")
        assert "planner: split colocated into 1 prefill + 1 decode worker with 1 thread(s) each" in log
        assert re.search(r"colocated worker colocated-0 left its pool \(exit code 0\)", log), log
        wait_blocks_baseline(served, [p, d])
    finally:
        stop(served)


def test_planner_makes_no_split_its_latency_models_predict_worse(tmp_path, tok, prompts, greedy):
    """The same TPOT-bound stream with latency models in which a decode step takes 0.1 us
    on two threads and 1 s on one: the simulated split misses the SLO everywhere, so the
    planner keeps the colocated worker and says why, every request served, its blocks back."""
    from pdserve.common.latency_model import Curve, DecodeFit, LatencyModel
    paths = []
    for threads, step_s in ((2, 1e-7), (1, 1.0)):
        m = LatencyModel(Curve(((0.0, 1e-6), (4096.0, 1e-6))), DecodeFit(step_s, 0.0, 0.0),
                         Curve(((0.0, 0.0), (1024.0, 0.0))), {"num_threads": threads})
        paths.append(tmp_path / f"latency_{threads}.json")
        m.save(paths[-1])
    split = [a for a in PLANNER if a != "--planner-max-workers" and a != "3"]
    split[split.index("--slo-ttft-ms") + 1], split[split.index("--slo-tpot-ms") + 1] = "100000", "0.001"
    served = serve(tmp_path, ["--colocated", "1"], extra=(*split, "--planner-host-cores", "2",
                                                          "--planner-latency-models", ",".join(map(str, paths))))
    vetoed = re.compile(r'^pdserve_planner_decisions_total\{action="none",reason="split_predicted_worse"\} ([\d.]+)$',
                        re.M)
    try:
        with streaming(served, tok, prompts) as results:
            deadline = time.monotonic() + 60
            while not (m := vetoed.search(urllib.request.urlopen(served.base + "/metrics", timeout=10).read().decode())) \
                    or float(m.group(1)) < 3:
                assert time.monotonic() < deadline, served.log_tail()
                time.sleep(0.5)
        check_outputs(served, results, greedy)
        assert health(served)["workers"] == {"prefill": 0, "decode": 0, "colocated": 1}
        log = served.log.read_text(errors="replace")
        assert "planner: no change (split_predicted_worse)" in log and "predicted_split=0.0" in log, log
        assert "planner: split" not in log
        wait_blocks_baseline(served, ["colocated-0"])
    finally:
        stop(served)
