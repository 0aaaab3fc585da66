"""`pdserve profile MODEL`: measure what this deployment's steps cost and write the
latency model (router/latency_model.py) that the router's cost mode reads.

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
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.common.config import ConfigError, EngineConfig, EngineOptions
from pdserve.common.engine.engine import LLMEngine
from pdserve.common.engine.kv_layout import kv_cache_tensor
from pdserve.common.engine.model_runner import kv_cache_shape
from pdserve.common.models.precision import kv_cache_dtype
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.worker.spec import role_engine
from pdserve.kv_transfer import resolve_backend
from pdserve.kv_transfer.base import copy_blocks
from pdserve.router.latency_model import Curve, DecodeFit, LatencyModel

MEASURED_BACKENDS = ("shm", "tcp", "cuda_ipc")
FIRST_ORDINARY_TOKEN = 3  # random prompts avoid the lowest ids, special tokens in made models


@dataclass(frozen=True)
class ProfilePlan:
    """What to measure: sizes per part, repetitions."""

    prefill_tokens: tuple[int, ...] = (16, 64, 256, 1024)
    batches: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (64, 512)
    blocks: tuple[int, ...] = (1, 8, 64)
    decode_steps: int = 8
    reps: int = 3

    def fitted_to(self, max_model_len: int, max_num_seqs: int) -> "ProfilePlan":
        """The plan without the sizes this engine cannot run; ConfigError if too little is left."""
        room = max_model_len - self.decode_steps - 2
        prefill = sorted({min(n, max_model_len - 1) for n in self.prefill_tokens})  # a prompt leaves room for a token
        plan = ProfilePlan(tuple(prefill),
                           tuple(b for b in self.batches if b <= max_num_seqs),
                           tuple(c for c in self.contexts if c <= room), self.blocks, self.decode_steps, self.reps)
        if len(plan.prefill_tokens) < 2 or len(set(plan.blocks)) < 2 or not plan.batches or not plan.contexts:
            raise ConfigError(f"profile: need >= 2 prefill sizes (below max_model_len {max_model_len}), >= 2 block "
                              f"counts, and a batch <= max_num_seqs {max_num_seqs} with a context that fits")
        if self.reps < 1 or self.decode_steps < 1 or min(self.blocks) < 1:
            raise ConfigError("profile: --reps, --decode-steps and every block count must be >= 1")
        return plan

    def kv_blocks(self, block_size: int, max_model_len: int) -> int:
        """Cache blocks the plan needs at once (its largest decode batch or transfer; an
        engine's cache holds at least one sequence of max_model_len)."""
        decode = max(self.batches) * -(-(max(self.contexts) + self.decode_steps + 2) // block_size)
        return max(decode, max(self.blocks), -(-max_model_len // block_size)) + 16


def _prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(FIRST_ORDINARY_TOKEN, vocab, size=n).tolist()


def measure_prefill(engine: LLMEngine, plan: ProfilePlan, rng: np.random.Generator) -> list[tuple[int, float]]:
    vocab, out = engine.config.model.vocab_size, []
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for n in plan.prefill_tokens:
        for rep in range(plan.reps + 1):  # the first is a warm-up
            engine.add_request(_prompt(rng, n, vocab), params)
            t0 = time.perf_counter()
            while engine.has_work():
                engine.step()
            if rep:
                out.append((n, time.perf_counter() - t0))
    return out


def measure_decode(engine: LLMEngine, plan: ProfilePlan, rng: np.random.Generator) -> list[tuple[int, float, float]]:
    """(batch, mean context during the timed steps, median step seconds) per batch and context."""
    vocab, out = engine.config.model.vocab_size, []
    params = SamplingParams(temperature=0.0, max_tokens=plan.decode_steps + 2, ignore_eos=True)
    for batch in plan.batches:
        for context in plan.contexts:
            seqs = [engine.add_request(_prompt(rng, context, vocab), params) for _ in range(batch)]
            while any(s.num_output_tokens == 0 for s in seqs):  # their prefills, untimed
                engine.step()
            times = []
            for _ in range(plan.decode_steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            for s in seqs:
                engine.abort(s)
            out.append((batch, float(context + 1 + plan.decode_steps / 2), float(np.median(times))))
    return out


def measure_transfer(config: EngineConfig, src: torch.Tensor, backend: str, plan: ProfilePlan) -> list[tuple[int, float]]:
    """Seconds to move the KV of n blocks of `src` into another cache, per n."""
    shape, dtype = kv_cache_shape(config, max(plan.blocks)), kv_cache_dtype(config.device)
    move, close = _mover(backend, src, shape, dtype, config)
    out = []
    try:
        for n in sorted(set(plan.blocks)):
            ids = list(range(n))
            for rep in range(plan.reps + 1):
                t0 = time.perf_counter()
                move(ids)
                if rep:
                    out.append((n, time.perf_counter() - t0))
    finally:
        close()
    return out


def _mover(backend: str, src: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, config: EngineConfig
           ) -> tuple[Callable[[list[int]], None], Callable[[], None]]:
    """(move(block ids), close()) for one backend, moving blocks i -> i."""
    layers = range(config.model.num_layers)
    if backend == "shm":
        from multiprocessing import resource_tracker

        from pdserve.kv_transfer.shm import ShmReceiver, ShmSender
        receiver = ShmReceiver(shape, dtype, f"profile-{os.getpid()}")
        sender = ShmSender(src, receiver.backend_info())
        # the sender, made for another process, took the segment off this process's
        # resource tracker; here the receiver owns it, and unlinks it on close
        resource_tracker.register(receiver._shm._name, "shared_memory")  # type: ignore[union-attr]

        def close_shm() -> None:
            sender.close()
            receiver.close()
        return (lambda ids: [sender.write_layer(layer, ids, ids) for layer in layers]), close_shm
    if backend == "tcp":
        return _tcp_mover(src, shape, dtype)
    if backend == "cuda_ipc":
        dst = kv_cache_tensor(shape, dtype, src.device)

        def move_device(ids: list[int]) -> None:
            copy_blocks(dst, src, ids, ids)
            torch.cuda.synchronize(src.device)
        return move_device, lambda: None
    raise AssertionError(f"no mover for {backend!r}")  # run_profile checked it


def _tcp_mover(src: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
               ) -> tuple[Callable[[list[int]], None], Callable[[], None]]:
    import zmq

    from pdserve.common.wire.messages import KVReady
    from pdserve.kv_transfer.tcp import TcpReceiver, TcpSender
    ctx = zmq.Context()
    p_sock, d_sock = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = p_sock.bind_to_random_port("tcp://127.0.0.1")
    d_sock.connect(f"tcp://127.0.0.1:{port}")
    sender, receiver = TcpSender(src, {}), TcpReceiver(kv_cache_tensor(shape, dtype, "cpu"))

    def move(ids: list[int]) -> None:
        ready = KVReady("profile", 0, len(ids))
        p_sock.send_multipart(sender.send(ready, ids, ids), copy=False)
        receiver.receive(ready, d_sock.recv_multipart(), ids, {})

    def close() -> None:
        p_sock.close(0)
        d_sock.close(0)
        ctx.term()
    return move, close


def run_profile(model_dir: str, options: EngineOptions, plan: ProfilePlan, kv_transfer: str = "auto",
                log: Callable[[str], None] = lambda _: None) -> LatencyModel:
    """Measure and fit; the engine's KV cache holds what the plan needs unless the options size it."""
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


def main(args: argparse.Namespace, model_dir: str, options: EngineOptions) -> int:
    """Without --num-threads, the threads `serve --prefill 1 --decode 1` gives each worker."""
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
