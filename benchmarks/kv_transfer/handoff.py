"""Part (b) of benchmarks/kv_transfer/run.py: prefill -> decode handoff latency of one
1024-token prompt through real P and D workers (router.launch.Launcher), one pair per CPU
backend, all up at once and taking turns. Owns the worker settings, the per-request
timeline breakdown and the estimate of shm's copy time hidden inside prefill. Imported
by the script, which puts the repository root on sys.path first.
"""
from __future__ import annotations

import math
import random
import statistics
import time
from pathlib import Path

import zmq

from pdserve.common.worker.spec import WorkerSpec
from pdserve.common.wire.auth import DeploymentKey
from pdserve.router.launch.local import Launcher, free_port
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.messages import ErrorReply, GenerateRequest, StepOutputs
from pdserve.common.wire.transport import Client
from benchmarks.kv_transfer.bandwidth import CPU_BACKENDS, RECV_TIMEOUT_MS

# Handoff settings (part b), fixed by the brief.
PROMPT_LEN = 1024
WORKER_OPTS = {"num_threads": 1, "max_model_len": 2048, "num_kv_blocks": 256}
FIRST_TOKEN_ID = 3  # ids 0-2 are the tokenizer's special tokens


def start_pairs(launcher: Launcher, model_dir: str) -> dict[str, tuple[str, str]]:
    """One P and one D per CPU backend, all up at once; {backend: (P address, D address)}."""
    procs = {}
    for backend in CPU_BACKENDS:
        opts = {**WORKER_OPTS, "kv_transfer": backend}
        if backend == "gloo":
            # both must join the group before either is ready, so D cannot name P up front:
            # it handshakes on the first request that names P (the warm-up request)
            init = {"dist_init": f"tcp://127.0.0.1:{free_port()}", "world_size": 2}
            procs[backend] = (launcher.start(WorkerSpec.of(model_dir, "prefill", f"p-{backend}", **opts, **init, rank=0)),
                              launcher.start(WorkerSpec.of(model_dir, "decode", f"d-{backend}", **opts, **init, rank=1)))
        else:
            procs[backend] = (launcher.start(WorkerSpec.of(model_dir, "prefill", f"p-{backend}", **opts)), None)
    launcher.wait_ready(timeout=600)
    for backend, (p, d) in procs.items():
        if d is None:
            opts = {**WORKER_OPTS, "kv_transfer": backend, "prefill_peers": (p.address,)}
            procs[backend] = (p, launcher.start(WorkerSpec.of(model_dir, "decode", f"d-{backend}", **opts)))
    launcher.wait_ready(timeout=600)
    return {backend: (p.address, d.address) for backend, (p, d) in procs.items()}


def one_request(client: Client, request_id: str, prompt: list[int], prefill_addr: str) -> dict:
    sent = time.time()
    client.send(GenerateRequest(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                                prefill_addr, return_timeline=True, timeline={"client_send": sent}))
    first = None
    while True:
        msg = client.recv(timeout_ms=RECV_TIMEOUT_MS).msg
        if isinstance(msg, ErrorReply):
            raise RuntimeError(f"request {request_id} failed: {msg.message}")
        if not isinstance(msg, StepOutputs):
            raise RuntimeError(f"request {request_id}: unexpected {msg.TYPE!r} reply")
        (msg,) = msg.outputs  # one request in flight: its entry of the worker's step
        if first is None and msg.token_ids:
            first = time.time()
        if msg.finished:
            tl = msg.timeline or {}
            prefill = tl["prefill_end"] - tl["prefill_start"]
            return {"ttft_s": first - sent, "prefill_s": prefill, "ttft_minus_prefill_s": first - sent - prefill,
                    "prefill_wait_s": tl["prefill_start"] - tl["prefill_queued"],
                    "transfer_s": tl["kv_ready"] - tl["transfer_start"],
                    "p_transfer_s": tl["transfer_end"] - tl["transfer_start"],
                    "reserve_to_prefill_queued_s": tl["prefill_queued"] - tl["decode_reserved"],
                    "num_cached_tokens": msg.num_cached_tokens, "timeline": tl}


def layerwise(backend: str) -> bool:
    """Whether the backend's sender pushes KV layer by layer during the forward."""
    from pdserve.kv_transfer.shm import ShmSender
    from pdserve.kv_transfer.tcp import TcpSender
    from pdserve.kv_transfer.torch_dist import DistSender
    return {"shm": ShmSender, "tcp": TcpSender, "gloo": DistSender}[backend].layerwise


def run_handoff(model_dir: Path, reps: int, bandwidth: list[dict]) -> dict:
    """All three P/D pairs run at once and take turns (order rotated every round), one
    request in flight at a time, so load drift on a shared machine spreads over all of
    them; round 0 is the warm-up. Every pair gets the same prompts (their caches are
    separate), and no prompt repeats within a pair."""
    from pdserve.common.config import EngineConfig
    from pdserve.common.engine.model_runner import bytes_per_block
    config = EngineConfig.build(str(model_dir), max_model_len=2048)
    rng = random.Random(0)
    prompts = [[rng.randrange(FIRST_TOKEN_ID, config.model.vocab_size) for _ in range(PROMPT_LEN)]
               for _ in range(1 + reps)]
    runs: dict[str, list[dict]] = {b: [] for b in CPU_BACKENDS}
    with Launcher() as launcher:
        addresses = start_pairs(launcher, str(model_dir))
        ctx = zmq.Context()
        key = DeploymentKey(launcher.secret)  # the secret the launcher wrote into the workers' configs
        clients = {b: Client(ctx, addresses[b][1], key=key) for b in CPU_BACKENDS}
        try:
            for i, prompt in enumerate(prompts):
                order = CPU_BACKENDS[i % 3:] + CPU_BACKENDS[:i % 3]
                for b in order:
                    result = one_request(clients[b], f"{b}-{i}", prompt, addresses[b][0])
                    if i:
                        runs[b].append(dict(result, round=i))
        finally:
            for c in clients.values():
                c.close()
            ctx.term()
    keys = ("ttft_s", "prefill_s", "ttft_minus_prefill_s", "prefill_wait_s", "transfer_s", "p_transfer_s",
            "reserve_to_prefill_queued_s")
    out: dict = {b: {"runs": runs[b], "median": {k: statistics.median(r[k] for r in runs[b]) for k in keys},
                     "min": {k: min(r[k] for r in runs[b]) for k in keys},
                     "max": {k: max(r[k] for r in runs[b]) for k in keys},
                     "prefix_cache_hit_tokens": sum(r["num_cached_tokens"] for r in runs[b]),
                     "overlaps_compute": layerwise(b)} for b in CPU_BACKENDS}
    kv_bytes = -(-PROMPT_LEN // config.cache.block_size) * bytes_per_block(config)
    shm_rows = [r for r in bandwidth if r["backend"] == "shm"]
    estimate = {"kv_bytes": kv_bytes,
                "prefill_shm_minus_tcp_s": out["shm"]["median"]["prefill_s"] - out["tcp"]["median"]["prefill_s"]}
    for order in ("contiguous", "reversed"):
        rows = [r for r in shm_rows if r["variant"].startswith(order)]
        if rows:  # the measured size nearest the prompt's KV
            nearest = min(rows, key=lambda r: abs(math.log(r["bytes"] / kv_bytes)))
            estimate[f"from_bandwidth_{order}_s"] = kv_bytes / (nearest["gbps"] * 1e9)
            estimate["bandwidth_row_bytes"] = nearest["bytes"]
    out["shm_write_estimate"] = estimate
    return out
