"""pdserve's GPU path at the size people serve (issue 52), every figure beside its limit
measured in the same run, in one JSON:

    python -m benchmarks.gpu.at_size --out docs/results/gpu/at_size_llama3-8b_h100.json   # on a GPU
    python -m benchmarks.gpu.at_size --device cpu --size tiny                              # the CPU stand-in (CI)

1. the model: `pdserve make-model --size llama3-8b` (bf16, drawn on the GPU) unless --model;
2. limits: a streaming read of device memory and a bf16 matrix product (cuBLAS);
3. decode: per-step time on the decode role's runner (CUDA graphs) at each batch and
   context, beside (weights + KV read per step) / read bandwidth; a batch whose KV does
   not fit beside the weights is reported skipped, with the bytes it needs; the decode
   attention kernel alone (64 x 1k) against the reference, with the KV bytes per second it reads;
4. prefill: one prompt of 4k tokens in one step, against the product's peak over the
   model's FLOPs; 16 mixed prompts fresh, and again with half of each cached (us per
   computed token, side by side); the prefill attention kernel alone against the SDPA loop
   it replaced;
5. exactness: float32 greedy tokens equal transformers' on the device (tiny models of each
   architecture, through the same kernels, CUDA graphs, cached prefixes and chunks);
6. against transformers: the engine's decode steps (scheduler included) and transformers'
   static-cache generate, eager and compiled, at batches 1 and 16 on the same folder;
7. targets: the issue's "done when" figures, each with its value and whether it is met.

The JSON is rewritten after every section, targets included (a run cut short keeps what it
measured). On a GPU the whole run takes ~4-6 minutes, most of it making the model and
compiling transformers' generate; `--deadline-s` leaves the compiled variant out when it
would not fit.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks.gpu import engine_runs as runs
from benchmarks.gpu import limits
from benchmarks.gpu import attention_ab
from benchmarks.harness.facts import run_facts
from benchmarks.harness.output import write_report

# What a run does by default on each kind of device: the sizes on a GPU; on the CPU
# a stand-in small enough for CI (seconds), the same sections and JSON.
PRESETS = {
    "cuda": dict(size="llama3-8b", dtype="bfloat16", batches="1,16,64,256", contexts="1024,4096", steps=32,
                 prefill_tokens=4096, rounds=3, mixed=",".join(str(256 * (i + 1)) for i in range(16)),
                 anchor_batches="1,16", anchor_prompt=512, anchor_tokens=64, hf="eager,compile",
                 matmul_size=8192, read_bytes=4 << 30, batched_tokens=8192),
    "cpu": dict(size="tiny", dtype="float32", batches="1,4", contexts="32,64", steps=4, prefill_tokens=128, rounds=1,
                mixed="16,40,64,100", anchor_batches="1,2", anchor_prompt=16, anchor_tokens=6, hf="eager",
                matmul_size=256, read_bytes=64 << 20, batched_tokens=256),
}
COMPILE_S = 180.0  # what --deadline-s keeps for transformers' compiled generate (two batch shapes)
RESERVE_GIB = 6.0  # device memory left beside the weights and the KV cache: activations, graphs, logits
PREFIX_SHARE = 0.5  # of each mixed prompt, cached before the timed run
TARGETS = {  # issue 52's "done when": figure -> (at most / at least, bound)
    "decode_batch1_vs_weights_bound": ("<=", 1.25),
    "decode_batch64_ctx1k_vs_weights_kv_bound": ("<=", 1.35),
    "prefill_4k_share_of_matmul_peak": (">=", 0.60),
    "mixed_cached_vs_fresh_us_per_token": ("<=", 1.0),
    "batch1_step_vs_transformers": ("<=", 1.0),
    "batch16_step_vs_transformers": ("<=", 1.0),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="", help="a model folder (default: make one of --size in a temporary folder)")
    ap.add_argument("--size", help="pdserve make-model size (preset: llama3-8b on a GPU, tiny on the CPU)")
    ap.add_argument("--dtype", help="engine and transformers dtype (preset: bfloat16 on a GPU, float32 on the CPU)")
    ap.add_argument("--batches", help="decode batch sizes, comma-separated")
    ap.add_argument("--contexts", help="decode context lengths, comma-separated")
    ap.add_argument("--steps", type=int, help="timed decode steps per point")
    ap.add_argument("--prefill-tokens", type=int, help="the one long prompt's length")
    ap.add_argument("--rounds", type=int, help="rounds of the long prefill (the best is held against the peak)")
    ap.add_argument("--mixed", help="the mixed prompts' lengths, comma-separated")
    ap.add_argument("--anchor-batches", help="batches of the comparison with transformers")
    ap.add_argument("--anchor-prompt", type=int, help="prompt length in the comparison with transformers")
    ap.add_argument("--anchor-tokens", type=int, help="tokens generated per sequence in that comparison")
    ap.add_argument("--hf", help="transformers variants: eager,compile (or off)")
    ap.add_argument("--matmul-size", type=int, help="the peak probe's square matrix size")
    ap.add_argument("--read-bytes", type=int, help="the bandwidth probe's buffer size")
    ap.add_argument("--batched-tokens", type=int, help="the engine's token budget per step")
    ap.add_argument("--no-exactness", dest="exactness", action="store_false",
                    help="leave out the float32 greedy check against transformers on the tiny models")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="seconds the whole run may take (0: no limit): the compiled transformers variant, whose "
                         "compilation takes minutes, is left out when less than COMPILE_S remain")
    ap.add_argument("--out", default="", help="write the JSON report here (e.g. docs/results/gpu/at_size_<chip>.json)")
    args = ap.parse_args(argv)
    preset = PRESETS["cuda" if args.device.startswith("cuda") else "cpu"]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def device_facts(device: torch.device) -> dict:
    import transformers
    import triton
    facts = {"device": str(device), "torch": torch.__version__, "triton": triton.__version__,
             "transformers": transformers.__version__, "commit": _commit()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        facts.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                     cuda=torch.version.cuda)
    return facts


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        return None


class Report:
    """The run's JSON, rewritten after every section when --out is given, the targets
    recomputed from what ran so far each time."""

    def __init__(self, out: str, head: dict) -> None:
        self.out = out
        self.data = head

    def section(self, name: str, fn) -> dict | None:
        t0 = time.perf_counter()
        print(f"[at_size] {name} ...", flush=True)
        try:
            result = fn()
        except Exception as e:  # one broken section leaves the others
            result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            print(result["traceback"], file=sys.stderr, flush=True)
        result["seconds"] = round(time.perf_counter() - t0, 2)
        self.data[name] = result
        self.data["targets"] = targets(self.data)  # as far as the run got: a run cut short keeps them
        print(f"[at_size] {name}: {json.dumps(result, default=str)[:600]}", flush=True)
        if self.out:
            write_report(self.data, self.out)
        return result


def kv_budget_blocks(args, device: torch.device, model_dir: str, block_bytes: int) -> int:
    """Blocks the decode grid needs at most, within what the device has beside the weights."""
    batches, contexts = ints(args.batches), ints(args.contexts)
    most = max(runs.blocks_for(b, c, args.steps + 3, 16) for b in batches for c in contexts)
    need = max(most, 2 * sum(ints(args.mixed)) // 16 + 64, args.prefill_tokens // 16 + 64)
    if device.type != "cuda":
        return need
    free, _ = torch.cuda.mem_get_info(device)
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    if args.dtype == "float32":
        weights *= 2  # bf16 on disk, float32 on the device
    fits = int((free - weights - RESERVE_GIB * 2**30) // block_bytes)
    return max(1, min(need, fits))


def decode_grid(args, llm, bw: float) -> dict:
    runs.fill_cache(llm)
    weights = runs.weight_bytes_per_step(llm.engine.runner.model)
    per_token = runs.kv_bytes_per_token(llm)
    num_blocks = llm.engine.runner.num_blocks
    rows = []
    for context in ints(args.contexts):
        for batch in ints(args.batches):
            need = runs.blocks_for(batch, context, args.steps + 3, llm.engine.config.cache.block_size)
            if need > num_blocks:
                rows.append({"batch": batch, "context": context, "skipped": f"the KV of {need} blocks "
                             f"({need * per_token * 16 / 2**30:.1f} GiB) does not fit beside the weights "
                             f"({num_blocks} blocks)"})
                continue
            row = runs.decode_step(llm, batch, context, args.steps)
            kv = batch * (context + 3 + args.steps / 2) * per_token  # mean context over the timed steps
            row.update(weight_bytes=weights, kv_bytes=int(kv), weights_bound_ms=weights / bw * 1e3,
                       bound_ms=(weights + kv) / bw * 1e3)
            row["vs_weights_bound"] = row["step_ms"] / row["weights_bound_ms"]
            row["vs_bound"] = row["step_ms"] / row["bound_ms"]
            rows.append(row)
            print(f"  decode {row}", flush=True)
    cfg, runner = llm.engine.config.model, llm.engine.runner
    batch, context = max(ints(args.batches)[:3]), min(ints(args.contexts))  # 64 x 1k on a GPU
    kernel = attention_ab.decode(runner.device, runner.kv_cache.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 llm.engine.config.cache.block_size, batch, context)
    kernel["vs_read_bandwidth"] = kernel["kv_gb_per_s"] * 1e9 / bw
    return {"rows": rows, "attention_kernel": kernel, "weight_bytes_per_step": weights, "kv_bytes_per_token": per_token,
            "read_gb_per_s": bw / 1e9, "method": runs.__doc__.split("\n\n")[1].replace("\n", " ")}


def prefill(args, llm, peak_tflops: float) -> dict:
    one = runs.prefill_one(llm, args.prefill_tokens, args.rounds, seed=1)
    one["share_of_matmul_peak"] = one["tflops"] / peak_tflops
    lengths = ints(args.mixed)
    fresh = runs.prefill_mixed(llm, lengths, 0.0, seed=2)
    cached = runs.prefill_mixed(llm, lengths, PREFIX_SHARE, seed=3)
    cfg = llm.engine.config.model
    chunks = [(n - int(n * PREFIX_SHARE) // 16 * 16, n) for n in lengths]
    ab = attention_ab.prefill(llm.engine.runner.device, llm.engine.runner.kv_cache.dtype, cfg.num_heads,
                              cfg.num_kv_heads, cfg.head_dim, llm.engine.config.cache.block_size, chunks)
    return {"one_prompt": one, "mixed_fresh": fresh, "mixed_cached_prefixes": cached,
            "cached_vs_fresh_us_per_token": cached["us_per_computed_token"] / fresh["us_per_computed_token"],
            "attention_kernel_vs_sdpa_loop": ab}


def anchor_ours(args, llm) -> dict:
    return {"rows": [runs.engine_decode(llm, b, args.anchor_prompt, args.anchor_tokens, seed=10 + b)
                     for b in ints(args.anchor_batches)]}


def anchor_hf(args, model_dir: str, device: torch.device) -> dict:
    from benchmarks.gpu import hf_anchor
    variants = [v for v in args.hf.split(",") if v and v != "off"]
    if not variants:
        return {"skipped": "--hf off"}
    model, load_s = hf_anchor.load(model_dir, device, getattr(torch, args.dtype))
    rows = []
    for variant in variants:
        left = args.deadline_s - (time.monotonic() - args.started) if args.deadline_s else float("inf")
        if variant == "compile" and left < COMPILE_S:
            rows.append({"compiled": True, "skipped": f"{left:.0f} s left of --deadline-s, under the {COMPILE_S:.0f} s "
                                                      "kept for compiling"})
            continue
        for b in ints(args.anchor_batches):
            row = hf_anchor.generate_steps(model, b, args.anchor_prompt, args.anchor_tokens, variant == "compile",
                                           seed=10 + b)
            rows.append(row)
            print(f"  transformers {row}", flush=True)
    del model
    return {"load_s": load_s, "rows": rows}


def targets(data: dict) -> dict:
    """The issue's figures from what ran, each {value, bound, met}; absent where it did not run
    (or its section failed)."""
    got: dict[str, float] = {}
    rows = data.get("decode", {}).get("rows", [])
    b1 = [r for r in rows if r.get("batch") == 1 and "step_ms" in r]
    if b1:
        got["decode_batch1_vs_weights_bound"] = min(b1, key=lambda r: r["context"])["vs_weights_bound"]
    b64 = [r for r in rows if r.get("batch") == 64 and r.get("context") == 1024 and "step_ms" in r]
    if b64:
        got["decode_batch64_ctx1k_vs_weights_kv_bound"] = b64[0]["vs_bound"]
    pre = data.get("prefill", {})
    if "one_prompt" in pre:
        got["prefill_4k_share_of_matmul_peak"] = pre["one_prompt"]["share_of_matmul_peak"]
        got["mixed_cached_vs_fresh_us_per_token"] = pre["cached_vs_fresh_us_per_token"]
    ours = {r["batch"]: r["ms_per_step_median"] for r in data.get("anchor_pdserve", {}).get("rows", [])}
    hf_rows = data.get("anchor_transformers", {}).get("rows", [])
    for b in (1, 16):
        theirs = [r["ms_per_step_median"] for r in hf_rows if r.get("batch") == b]
        if b in ours and theirs:
            got[f"batch{b}_step_vs_transformers"] = ours[b] / min(theirs)  # against their best variant
    out = {}
    for name, (op, bound) in TARGETS.items():
        if name in got:
            value = got[name]
            out[name] = {"value": value, "bound": f"{op} {bound}", "met": value <= bound if op == "<=" else value >= bound}
    return out


def engine_sections(report: Report, args, model_dir: str, device: torch.device, bw: float, peak: float) -> None:
    """Load pdserve's engine on the model, then its decode, prefill and anchor sections."""
    from pdserve.common.config import EngineConfig
    from pdserve.common.engine.llm import LLM
    from pdserve.common.engine.model_runner import bytes_per_block
    longest = max(max(ints(args.contexts)) + args.steps + 8, args.prefill_tokens, max(ints(args.mixed)),
                  args.anchor_prompt + args.anchor_tokens) + 16
    opts = dict(device=str(device), dtype=args.dtype, max_model_len=longest, max_num_seqs=max(ints(args.batches)),
                max_num_batched_tokens=max(args.batched_tokens, args.prefill_tokens), decode_graphs=True, seed=0)
    held: dict = {}

    def load() -> dict:
        block_bytes = bytes_per_block(EngineConfig.build(model_dir, **opts, num_kv_blocks=1 << 20))
        blocks = kv_budget_blocks(args, device, model_dir, block_bytes)
        t0 = time.perf_counter()
        held["llm"] = LLM(model_dir, **opts, num_kv_blocks=blocks)
        return {"load_s": time.perf_counter() - t0, "num_kv_blocks": blocks, "kv_cache_gib": blocks * block_bytes / 2**30,
                "options": opts}

    report.section("engine", load)
    if "llm" not in held:
        return
    llm = held.pop("llm")
    report.section("decode", lambda: decode_grid(args, llm, bw))
    report.section("prefill", lambda: prefill(args, llm, peak))
    report.section("anchor_pdserve", lambda: anchor_ours(args, llm))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.started = time.monotonic()
    device = torch.device(args.device)
    report = Report(args.out, {"run": run_facts(), "args": {k: v for k, v in vars(args).items() if k != "started"},
                               "env": device_facts(device)})
    tmp = tempfile.TemporaryDirectory(prefix="pdserve-at-size-")
    model_dir = args.model

    def make() -> dict:
        from pdserve.common.loading.model_factory import SIZES, make_model
        t0 = time.perf_counter()
        d = make_model(Path(tmp.name) / args.size, size=args.size, seed=0,
                       device=str(device) if device.type == "cuda" else "cpu")
        return {"size": args.size, "dir": str(d), "parameters": SIZES[args.size].num_parameters(),
                "make_model_s": time.perf_counter() - t0}

    if not model_dir:
        made = report.section("model", make)
        model_dir = made.get("dir", "")
        if not model_dir:
            return 1
    lim = report.section("limits", lambda: {
        "read": limits.read_bandwidth(device, args.read_bytes),
        "matmul": limits.matmul_peak(device, getattr(torch, args.dtype), args.matmul_size)})
    if "error" in lim:
        return 1
    bw = lim["read"]["read_gb_per_s"] * 1e9
    peak = lim["matmul"]["tflops"]
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probes' buffers: free for the KV cache's budget

    engine_sections(report, args, model_dir, device, bw, peak)  # the engine freed on return
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.exactness:
        from benchmarks.gpu import exactness
        report.section("exactness", lambda: exactness.check(device))
    report.section("anchor_transformers", lambda: anchor_hf(args, model_dir, device))
    if not args.out:
        print(json.dumps(report.data, indent=1, default=str))
    tmp.cleanup()
    failed = [k for k, v in report.data.items() if isinstance(v, dict) and "error" in v]
    print(f"[at_size] targets: {json.dumps(report.data['targets'])}; sections failed: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
