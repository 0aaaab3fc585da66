"""The GPU paths, run on a GPU (docs/gpu.md has what it printed): Triton kernels compiled
for the device against their torch references, CUDA-graph capture and replay in the
decode runner (greedy tokens against eager and transformers, decode step times), CUDA IPC
and NCCL between two processes, a served disaggregated run with P and D on the GPU
next to a colocated worker, and pools split and merged under traffic (gpu_check_elastic.py).

    python benchmarks/gpu_check.py --out results/gpu_check.json [--device cuda:0] [--only engine,ipc]
    python benchmarks/gpu_check.py --model default --only engine,bf16,graph_speed,serving   # the default SmolLM2

Each check reports ok or failed with its error, so one broken path does not hide the
others; the JSON is rewritten after every check. With `--device cpu` the same checks run
through the CPU stand-ins (interpreted Triton, eager buckets, shm, gloo), which is how the
script itself is tried on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from gpu_check_elastic import check_elastic  # noqa: E402
from gpu_check_features import check_features  # noqa: E402
from gpu_check_models import ARCHS, given_model, hf_greedy, make_models, prompts_for  # noqa: E402
from gpu_check_transfer import check_cuda_ipc, check_nccl, on_gpu, sync, timed  # noqa: E402
from benchmarks.harness.servers import log, repo_pythonpath, start_pdserve  # noqa: E402

MAX_NEW = 16
SEEDED = [dict(temperature=1.0, seed=11), dict(temperature=0.8, top_p=0.9, seed=12),
          dict(temperature=1.3, top_k=20, seed=13)]  # as tests/disagg: one random stream per request


def seeded_prompts(model_dir: str) -> list[list[int]]:
    return [p[:n] for p, n in zip(prompts_for(model_dir)[-3:], (9, 40, 23))]


def seeded_one_engine(model_dir: str, device: str, graphs: bool = False) -> list[list[int]]:
    """Seeded random outputs of one engine doing both phases."""
    from pdserve.common.sampling_params import SamplingParams
    llm = _llm(model_dir, device, graphs)
    params = [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, **kw) for kw in SEEDED]
    return [o["token_ids"] for o in llm.generate(seeded_prompts(model_dir), params, use_tqdm=False)]


# ---- checks -----------------------------------------------------------------------------------

def check_env(args, models) -> dict:
    import triton
    out = {"torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0],
           "device": args.device}
    if on_gpu(args.device):
        p = torch.cuda.get_device_properties(args.device)
        out.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count,
                   cuda=torch.version.cuda)
    return out


def check_triton(args, models) -> dict:
    """The Triton kernels' tests, compiled for the device, then the kernels timed at a
    serving-sized shape against the torch references."""
    env = dict(os.environ, TRITON_INTERPRET="0" if on_gpu(args.device) else "1", PYTHONPATH=repo_pythonpath())
    t = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_triton_kernels.py"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out: dict = {"pytest_rc": t.returncode, "pytest_tail": t.stdout.strip().splitlines()[-1:], "ok": t.returncode == 0}
    if not on_gpu(args.device):
        return out
    torch.manual_seed(0)
    rows = [_kernel_row(dtype, args.device) for dtype in (torch.float32, torch.bfloat16, torch.float16)]
    out["kernels"] = rows
    out["ok"] = out["ok"] and all(r["store_kv_exact"] and r["gather_exact"] and r["scatter_exact"] for r in rows)
    return out


def _kernel_row(dtype: torch.dtype, dev: str) -> dict:
    """One dtype: decode attention (64 sequences of up to 1024 tokens, 32 query and 8 KV
    heads of 128), store_kv, gather and scatter, against the references."""
    from pdserve import kernels
    from pdserve.kernels import reference as R
    b, hq, hkv, d, bs, ctx = 64, 32, 8, 128, 16, 1024
    nb = b * ctx // bs
    kc = torch.randn(nb, bs, hkv, d, device=dev).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, device=dev).to(dtype)
    q = torch.randn(b, hq, d, device=dev).to(dtype)
    tables = torch.randperm(nb, device=dev).view(b, ctx // bs).to(torch.int32)
    lens = torch.randint(1, ctx + 1, (b,), device=dev, dtype=torch.int32)
    ref = R.paged_decode_attention(q.float(), kc.float(), vc.float(), tables, lens, d ** -0.5)
    got = kernels.triton_paged_decode_attention(q, kc, vc, tables, lens, d ** -0.5)
    t_tri = timed(lambda: kernels.triton_paged_decode_attention(q, kc, vc, tables, lens, d ** -0.5), dev)
    t_ref = timed(lambda: R.paged_decode_attention(q, kc, vc, tables, lens, d ** -0.5), dev, reps=5)
    kv_bytes = 2 * int(lens.sum()) * hkv * d * kc.element_size()
    slots = torch.randperm(nb * bs, device=dev)[:4096]
    key = torch.randn(4096, hkv, d, device=dev).to(dtype)
    k2, v2, k3, v3 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    kernels.triton_store_kv(key, key, k2, v2, slots)
    R.store_kv(key, key, k3, v3, slots)
    ids = torch.randperm(nb, device=dev)[:1024]
    gathered = kernels.triton_gather_blocks(kc, ids)
    t_gather = timed(lambda: kernels.triton_gather_blocks(kc, ids), dev)
    sc, sc_ref = kc.clone(), kc.clone()
    kernels.triton_scatter_blocks(sc, ids, gathered.flip(0))
    R.scatter_blocks(sc_ref, ids, gathered.flip(0))
    row = {"dtype": str(dtype).removeprefix("torch."),
           "decode_attention_max_abs_err": float((got.float() - ref).abs().max()),
           "decode_attention_triton_us": t_tri * 1e6, "decode_attention_torch_ref_us": t_ref * 1e6,
           "decode_attention_kv_gb_per_s": kv_bytes / t_tri / 1e9,
           "store_kv_exact": bool(torch.equal(k2, k3) and torch.equal(v2, v3)),
           "gather_exact": bool(torch.equal(gathered, R.gather_blocks(kc, ids))),
           "scatter_exact": bool(torch.equal(sc, sc_ref)),
           "gather_gb_per_s": 2 * gathered.numel() * gathered.element_size() / t_gather / 1e9}
    log(f"  triton {row}")
    return row


def _llm(model_dir: str, device: str, graphs: bool, dtype: str = "float32", **kw):
    from pdserve.common.engine.llm import LLM
    opts = dict(device=device, dtype=dtype, num_kv_blocks=1024, max_model_len=1024, max_num_seqs=64,
                decode_graphs=graphs, seed=0, quantization="none")  # a GGUF's folder: its dequantized weights
    opts.update(kw)
    if not on_gpu(device):
        opts["num_threads"] = 2
    return LLM(model_dir, **opts)


def check_engine(args, models) -> dict:
    """Greedy tokens, offline: transformers on the device vs our engine eager and with the
    decode steps through the graph runner (CUDA graphs on GPU), every architecture."""
    from pdserve.common.sampling_params import SamplingParams
    res: dict = {}
    for name, d in models.items():
        prompts = prompts_for(d)
        want = hf_greedy(d, prompts, MAX_NEW, args.device)
        row: dict = {}
        for graphs in (False, True):
            llm = _llm(d, args.device, graphs)
            got = [o["token_ids"] for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0), use_tqdm=False)]
            runner = llm.engine.runner
            key = "graphs" if graphs else "eager"
            row[key] = {"match": got == want, "mismatched_prompts": [i for i, (a, b) in enumerate(zip(got, want)) if a != b]}
            if graphs:
                row[key].update(captured_buckets=sorted(getattr(runner, "graphs", {})), replays=runner.replays)
            del llm
        seeded = [seeded_one_engine(d, args.device, graphs) for graphs in (False, True)]
        row["seeded_graphs_equal_eager"] = seeded[0] == seeded[1] and len({tuple(t) for t in seeded[0]}) == 3
        res[name] = row
        log(f"  engine {name}: {row}")
    res["ok"] = all(r["eager"]["match"] and r["graphs"]["match"] and r["seeded_graphs_equal_eager"] for r in res.values())
    return res


def check_graph_speed(args, models) -> dict:
    """Decode step time, eager vs graph replay, on the small model: (time of 129 output
    tokens - time of 1) / 128 for a batch of 32-token prompts; also bf16 tokens graphs
    vs eager (no transformers oracle at bf16: ours against ours)."""
    from pdserve.common.sampling_params import SamplingParams
    d = models[args.speed_model]
    rows = []
    batches = (1, 8, 32, 64) if on_gpu(args.device) else (1, 4)
    for dtype in ("float32", "bfloat16"):
        toks = {}
        for graphs in (False, True):
            llm = _llm(d, args.device, graphs, dtype=dtype)
            for b in batches:
                prompts = [[5 + (i * 7 + j) % 200 for j in range(32)] for i in range(b)]
                sp = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
                llm.generate(prompts, sp(129), use_tqdm=False)  # warm-up: captures the buckets
                sync(args.device)
                t0 = time.perf_counter()
                llm.generate(prompts, sp(1), use_tqdm=False)
                sync(args.device)
                t1 = time.perf_counter()
                outs = llm.generate(prompts, sp(129), use_tqdm=False)
                sync(args.device)
                t2 = time.perf_counter()
                step_ms = ((t2 - t1) - (t1 - t0)) / 128 * 1e3
                toks[(graphs, b)] = [o["token_ids"] for o in outs]
                rows.append({"dtype": dtype, "graphs": graphs, "batch": b, "decode_step_ms": step_ms,
                             "decode_tok_per_s": b / step_ms * 1e3})
                log(f"  speed {rows[-1]}")
            del llm
        for b in batches:
            rows.append({"dtype": dtype, "batch": b, "graphs_tokens_equal_eager": toks[(True, b)] == toks[(False, b)]})
    return {"rows": rows, "ok": all(r.get("graphs_tokens_equal_eager", True) for r in rows)}


def check_pair(args, models) -> dict:
    """A real prefill worker and decode worker on the device, through the test driver:
    greedy tokens against transformers for every architecture, blocks all returned."""
    from tests.support.disagg_driver import engine_options, start_pair
    backends = ("cuda_ipc", "nccl") if on_gpu(args.device) else ("shm", "gloo")
    res: dict = {}
    nccl_ok = getattr(args, "nccl_ok", None)  # set by the nccl check, when it ran
    if nccl_ok is None:
        nccl_ok = not on_gpu(args.device) or torch.cuda.device_count() > 1
    if not nccl_ok:  # two processes on one GPU cannot form an NCCL group
        res["nccl-start"] = _nccl_pair_refused(models["qwen3"], args.device)
        backends = backends[:1]
    for backend in backends:
        for arch in ARCHS:
            d = models[arch]
            prompts = prompts_for(d)
            want = hf_greedy(d, prompts, MAX_NEW, args.device)
            opts = {**engine_options(num_kv_blocks=512, max_model_len=512), "device": args.device}
            key = f"{backend}-{arch}"
            try:
                dep = start_pair(d, backend, opts, prefill_options={"max_num_batched_tokens": 64},
                                 together=backend == "nccl", timeout_s=240)
            except Exception as e:
                res[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-3000:]}
                log(f"  pair {key}: failed to start")
                continue
            try:
                t0 = time.perf_counter()
                run = dep.run(prompts, MAX_NEW, timeout_s=120)
                secs = time.perf_counter() - t0
                got = run.outputs()
                reqs = [dep.request(p, MAX_NEW, ignore_eos=True, **kw) for p, kw in zip(seeded_prompts(d), SEEDED)]
                dep.send(reqs)
                seeded = dep.collect([r.request_id for r in reqs]).outputs()
                d_status, p_status = dep.statuses()
                res[key] = {"match": got == want and not run.errors, "errors": run.errors, "seconds": secs,
                            "mismatched_prompts": [i for i, (a, b) in enumerate(zip(got, want)) if a != b],
                            "decode_blocks_free": [d_status.free_blocks, d_status.total_blocks],
                            "prefill_blocks_free": [p_status.free_blocks, p_status.total_blocks]}
                res[key]["seeded_equal_one_engine"] = seeded == seeded_one_engine(d, args.device)
                res[key]["ok"] = (res[key]["match"] and res[key]["seeded_equal_one_engine"]
                                  and d_status.free_blocks == d_status.total_blocks)
            except Exception as e:
                res[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-2000:], "logs": dep.logs()[-3000:]}
            finally:
                dep.close()
            log(f"  pair {key}: {res[key]}")
    res["ok"] = all(v["ok"] for v in res.values())
    return res


def _nccl_pair_refused(model_dir: str, device: str) -> dict:
    """Where NCCL cannot form a group (one GPU for both), a P/D pair must fail at start-up
    with NCCL's reason, not start and then hang on the first transfer."""
    from tests.support.disagg_driver import engine_options, start_pair
    t0 = time.perf_counter()
    try:
        dep = start_pair(model_dir, "nccl", {**engine_options(), "device": device}, together=True, timeout_s=120)
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
        ok = "Duplicate GPU" in err
        return {"ok": ok, "refused_after_s": round(time.perf_counter() - t0, 1), "error": err[-1500:]}
    dep.close()
    return {"ok": False, "error": "the pair started although NCCL cannot put two ranks on one GPU"}


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def check_serving(args, models) -> dict:
    """`pdserve serve` with P and D on the device (and a colocated worker for comparison):
    greedy tokens over HTTP against transformers (at --serving-dtype bfloat16: against our
    offline engine, a prompt at a time), then a Poisson sweep with pdserve bench."""
    from pdserve.router.bench.arrivals import arrival_times
    from pdserve.router.stats.latency import summarize
    from pdserve.router.bench.runner import run_workload
    from pdserve.router.bench.workloads import random_workload
    d = models[args.speed_model]
    dev = args.device
    configs = {"1p1d": ["--prefill-devices", dev, "--decode-devices", dev],
               "colocated": ["--colocated-devices", dev]}
    prompts = prompts_for(d)
    want = hf_greedy(d, prompts, MAX_NEW, dev) if args.serving_dtype == "float32" else _one_by_one(d, prompts, args)
    rates = [float(r) for r in args.rates.split(",")]
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cfg, extra in configs.items():
            s = start_pdserve(cfg, d, Path(tmp), extra=extra, dtype=args.serving_dtype)
            try:
                model_id = json.loads(urllib.request.urlopen(s.url + "/models").read())["data"][0]["id"]
                got = [_post(s.url + "/completions", {"model": model_id, "prompt": p, "max_tokens": MAX_NEW,
                                                         "temperature": 0})["choices"][0]["token_ids"] for p in prompts]
                row: dict = {"greedy_match": got == want, "command": s.cmd, "points": []}  # type: ignore[attr-defined]
                vocab = 1000
                for i, rate in enumerate(rates):
                    reqs = random_workload(args.num_prompts, 256, 64, 0.0, vocab, seed=100 + i)
                    times = arrival_times(args.num_prompts, rate, 1.0, seed=i)
                    recs, dur = asyncio.run(run_workload(reqs, "http", s.url, times, None, 0.0, True, False, (), False))
                    m = summarize(recs, dur, 1.0, 0.05, (50, 99))
                    keep = ("completed", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
                            "output_throughput", "request_goodput", "slo_attainment")
                    row["points"].append({"rate": rate, **{k: m.get(k) for k in keep}})
                    log(f"  serve {cfg} {row['points'][-1]}")
                res[cfg] = row
            except Exception as e:
                res[cfg] = {"error": f"{type(e).__name__}: {e}", "log": s.log_path.read_text()[-4000:]}
            finally:
                s.stop()
    res["ok"] = all(v.get("greedy_match") for v in res.values())
    return res


def _one_by_one(model_dir: str, prompts: list[list[int]], args) -> list[list[int]]:
    """Greedy tokens of our offline engine at --serving-dtype, one prompt at a time (the
    reference below float32: a served request sent alone runs in a batch of one too)."""
    from pdserve.common.sampling_params import SamplingParams
    llm = _llm(model_dir, args.device, False, dtype=args.serving_dtype)
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    return [llm.generate([p], sp, use_tqdm=False)[0]["token_ids"] for p in prompts]


def check_bf16(args, models) -> dict:
    """bf16 against transformers by vLLM's rule below float32. The reference computes as
    ours does: on a GPU both cast the whole model to bf16 (transformers at bf16); on the
    CPU ours keeps float32 arithmetic over bf16 weights and a bf16 KV cache, so the
    reference is transformers in float32 over the same bf16-rounded weights. Where the
    greedy streams first differ, each side's token must be in the other's top-5 (ours: the
    engine's teacher-forced logits; theirs: transformers' forward on the same prefix). Eager and graphs, every model; the share identical to the end is reported."""
    from transformers import AutoModelForCausalLM

    from pdserve.common.engine.scoring import Divergence, first_divergence, rank, sequence_logits
    from pdserve.common.sampling_params import SamplingParams
    res: dict = {}
    for name, d in models.items():
        prompts = prompts_for(d)[:8]
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).to(args.device).eval()
        if not on_gpu(args.device):
            hf = hf.float()
        want = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p], device=args.device)
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
                want.append(out[0, len(p):].tolist())
        row: dict = {}
        for graphs in (False, True):
            llm = _llm(d, args.device, graphs, dtype="bfloat16")
            scorer = _llm(d, args.device, False, dtype="bfloat16", enable_prefix_caching=False)
            got = [o["token_ids"] for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
                                                       use_tqdm=False)]
            divs = []
            for p, a, b in zip(prompts, got, want):
                i = first_divergence(a, b)
                if i is None or i >= min(len(a), len(b)):
                    divs.append(Divergence(None))
                    continue
                prefix = p + a[:i]
                ours = sequence_logits(scorer.engine, prefix)[-1].float().cpu()
                with torch.no_grad():
                    theirs = hf(torch.tensor([prefix], device=args.device)).logits[0, -1].float().cpu()
                divs.append(Divergence(i, a[i], b[i], rank(theirs, a[i]), rank(ours, b[i])))
            row["graphs" if graphs else "eager"] = {
                "identical": sum(x.position is None for x in divs), "prompts": len(divs),
                "first_divergence": [x.position for x in divs], "within_top5": all(x.within_top(5) for x in divs),
                "ranks": [(x.a_rank_in_b, x.b_rank_in_a) for x in divs if x.position is not None]}
            del llm, scorer
        del hf
        res[name] = row
        log(f"  bf16 {name}: {row}")
    res["ok"] = all(r["eager"]["within_top5"] and r["graphs"]["within_top5"] for r in res.values() if isinstance(r, dict))
    return res


def check_sampling_features(args, models) -> dict:
    return check_features(args, models, _llm, prompts_for)


def check_pools(args, models) -> dict:
    return check_elastic(args, models, hf_greedy, prompts_for, MAX_NEW)


CHECKS = {"env": check_env, "triton": check_triton, "engine": check_engine, "bf16": check_bf16,
          "features": check_sampling_features, "graph_speed": check_graph_speed,
          "cuda_ipc": check_cuda_ipc, "nccl": check_nccl, "pair": check_pair, "serving": check_serving,
          "elastic": check_pools}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=str(REPO / "results" / "gpu_check.json"))
    ap.add_argument("--only", default="", help="comma-separated checks (default all): " + ",".join(CHECKS))
    ap.add_argument("--rates", default="5,20,50", help="serving sweep, req/s")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--model", default="",
                    help="a model folder or .gguf file to run the checks on instead of the random ones "
                         "(engine, bf16, graph_speed and serving use it; the default model: 'default')")
    ap.add_argument("--serving-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the served check's dtype; below float32 its greedy reference is our offline "
                         "engine at that dtype, one prompt at a time")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(CHECKS)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "checks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        models = given_model(args.model) if args.model else make_models(Path(tmp))
        args.speed_model = "small-qwen3" if not args.model else next(iter(models))
        for name in names:
            log(f"check {name}")
            t0 = time.perf_counter()
            try:
                r = CHECKS[name](args, models)
            except Exception as e:
                r = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
                log(r["traceback"])
            r["seconds"] = round(time.perf_counter() - t0, 1)
            report["checks"][name] = r
            log(f"check {name}: {'ok' if r.get('ok', True) else 'FAILED'} in {r['seconds']} s")
            out.write_text(json.dumps(report, indent=1, default=str))
    failed = [n for n, r in report["checks"].items() if not r.get("ok", True)]
    print(json.dumps({n: r.get("ok", True) for n, r in report["checks"].items()}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
