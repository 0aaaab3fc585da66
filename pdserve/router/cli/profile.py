"""`pdserve profile MODEL`: measure what this deployment's steps cost and write the
latency model (common/latency_model.py) that the router's cost mode reads.

One engine runs in this process with the worker's engine options (threads included):
  prefill   one fresh random prompt of each size (no prefix hit), first token sampled:
            seconds from queueing to its first token, all its chunks included;
  decode    `batch` sequences of `context` prompt tokens, prefilled first, then the
            median of `--decode-steps` timed steps in which they all decode;
  transfer  the KV of n blocks of this engine's cache moved into a decode worker's
            cache with the deployment's transfer backend (shm: a shared segment written
            layer by layer as P does; tcp: gathered, sent over a loopback ZeroMQ
            socket, scattered; cuda_ipc: a copy between two caches on the device).
Each size is measured `--reps` times after one warm-up; the file keeps the median per
size (prefill, transfer) and a least-squares fit of the decode step (docs/slo.md)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pdserve.common.config import ConfigError, EngineOptions
from pdserve.common.engine.profile import ProfilePlan, measure_decode, measure_prefill
from pdserve.common.latency_model import Curve, DecodeFit, LatencyModel
from pdserve.common.worker.spec import role_engine
from pdserve.common.worker.host import resolve_backend


def run_profile(model_dir: str, options: EngineOptions, plan: ProfilePlan, kv_transfer: str = "auto",
                log: Callable[[str], None] = lambda _: None) -> LatencyModel:
    """Measure and fit; the engine's KV cache holds what the plan needs unless the options size it."""
    import torch  # here, not at the top: every `pdserve` command's parser reads this module

    from pdserve.common.engine.engine import LLMEngine
    from pdserve.kv_transfer.profile import MEASURED_BACKENDS, measure_transfer
    options = role_engine(options, "decode")  # on a GPU, decode steps through CUDA graphs: 3-4x faster (docs/gpu.md)
    engine_config = options.engine_config(model_dir)
    plan = plan.fitted_to(engine_config.scheduler.max_model_len, engine_config.scheduler.max_num_seqs)
    if options.cache.num_kv_blocks is None:
        options = options.replace(num_kv_blocks=plan.kv_blocks(options.cache.block_size,
                                                                  engine_config.scheduler.max_model_len))
        engine_config = options.engine_config(model_dir)
    backend = resolve_backend(kv_transfer, engine_config.device.device)
    if backend not in MEASURED_BACKENDS:
        raise ConfigError(f"profile measures the {', '.join(MEASURED_BACKENDS)} transfers, not {backend!r}: write "
                          "its transfer points into the file by hand (docs/slo.md)")
    engine = LLMEngine(engine_config)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    prefill = measure_prefill(engine, plan, rng)
    log(f"prefill: {len(prefill)} prompts in {time.perf_counter() - t0:.1f} s")
    decode = measure_decode(engine, plan, rng)
    log(f"decode: {len(decode)} batch/context points in {time.perf_counter() - t0:.1f} s")
    transfer = measure_transfer(engine_config, engine.runner.kv_cache, backend, plan)
    log(f"transfer ({backend}): {len(transfer)} moves in {time.perf_counter() - t0:.1f} s")
    dev = engine_config.device
    meta = {"model": str(model_dir), "device": dev.device, "dtype": dev.dtype, "num_threads": torch.get_num_threads(),
            "block_size": engine_config.cache.block_size,
            "max_num_batched_tokens": engine_config.scheduler.max_num_batched_tokens, "kv_transfer": backend,
            "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    return LatencyModel(Curve.from_samples(prefill), DecodeFit.fit(decode), Curve.from_samples(transfer), meta,
                        tuple(decode))


def _engine_json(path: str) -> EngineOptions:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--engine-json {path}: {e}") from None
    return EngineOptions.from_dict(data, "--engine-json")


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ProfilePlan()
    join = lambda xs: ",".join(map(str, xs))  # noqa: E731
    p.add_argument("model", nargs="?", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="latency_model.json", help="where to write the latency model (JSON)")
    p.add_argument("--kv-transfer", default="auto", help="the deployment's transfer backend: auto, shm, tcp, cuda_ipc")
    p.add_argument("--prefill-tokens", type=_sizes, default=d.prefill_tokens, help=f"prompt sizes (default {join(d.prefill_tokens)})")
    p.add_argument("--batches", type=_sizes, default=d.batches, help=f"decode batch sizes (default {join(d.batches)})")
    p.add_argument("--contexts", type=_sizes, default=d.contexts, help=f"decode contexts, tokens (default {join(d.contexts)})")
    p.add_argument("--blocks", type=_sizes, default=d.blocks, help=f"KV blocks per transfer (default {join(d.blocks)})")
    p.add_argument("--decode-steps", type=int, default=d.decode_steps, help="timed decode steps per batch and context")
    p.add_argument("--reps", type=int, default=d.reps, help="timed repetitions per prefill and transfer size")
    # dest not engine_*: that prefix marks the engine flags (router/cli/flags.py ENGINE_DEST)
    p.add_argument("--engine-json", dest="options_json", default=None,
                   help="the engine options as a JSON object of their flat names (a worker spec's \"engine\"), "
                        "in place of the engine flags (serve's --planner-latency-models auto passes its own)")


def main(args: argparse.Namespace, model_dir: str, options: EngineOptions) -> int:
    """Without --num-threads, the threads `serve --prefill 1 --decode 1` gives each worker."""
    if args.options_json:
        options = _engine_json(args.options_json)
    if options.device.num_threads is None:
        options = options.replace(num_threads=max(1, (os.cpu_count() or 1) // 2))
    plan = ProfilePlan(args.prefill_tokens, args.batches, args.contexts, args.blocks, args.decode_steps, args.reps)
    model = run_profile(model_dir, options, plan, args.kv_transfer,
                        lambda msg: print(f"pdserve profile: {msg}", file=sys.stderr, flush=True))
    model.save(args.out)
    print(f"wrote {args.out}: prefill {[round(s * 1e3, 2) for _, s in model.prefill.points]} ms at "
          f"{[int(n) for n, _ in model.prefill.points]} tokens; decode step {model.decode.base_s * 1e3:.2f} ms + "
          f"{model.decode.per_seq_s * 1e3:.3f} ms/seq + {model.decode.per_token_s * 1e6:.3f} us/context token; "
          f"transfer {[round(s * 1e3, 3) for _, s in model.transfer.points]} ms at "
          f"{[int(n) for n, _ in model.transfer.points]} blocks")
    return 0
