"""benchmarks/gpu_check.py's two-process checks, and the device helpers all its checks
use: CUDA IPC (P writes into the cache D exported) and NCCL (two ranks move 256 MiB). The
child processes are spawned, so their entry points live in a module they can import."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import time

import msgpack
import torch

from benchmarks.harness.servers import log


def on_gpu(device: str) -> bool:
    return device.startswith("cuda")


def sync(device: str) -> None:
    if on_gpu(device):
        torch.cuda.synchronize(device)


def timed(fn, device: str, reps: int = 20) -> float:
    """Mean seconds per call after two warm-up calls."""
    fn(), fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps


# -- two processes: CUDA IPC (shm on CPU) and NCCL (gloo on CPU) --------------------------------

GEOM = dict(layers=32, num_blocks=1024, block_size=16, kv_heads=8, head_dim=128)  # an 8B model's KV, bf16: 2 MiB a block


def _cache(device: str, fill: bool) -> torch.Tensor:
    g = GEOM
    shape = (2, g["layers"], g["num_blocks"], g["block_size"], g["kv_heads"], g["head_dim"])
    if fill:
        gen = torch.Generator(device=device).manual_seed(0)
        return torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
    return torch.zeros(shape, dtype=torch.bfloat16, device=device)


def _digest(cache: torch.Tensor, blocks: list[int]) -> str:
    return hashlib.sha256(cache[:, :, blocks].contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


SRC = list(range(0, 512))
DST = list(range(1023, 511, -1))  # reversed: no run of consecutive blocks, one copy per block per layer
DST_RUNS = list(range(256, 768))  # one run: one copy per layer


def _ipc_decode(conn, device: str) -> None:
    """D: allocate the cache, export it, wait for P's writes, report the landed blocks' digest."""
    from pdserve.kv_transfer.cuda_ipc import export_handle
    cache = _cache(device, fill=False)
    conn.send_bytes(msgpack.packb(export_handle(cache)))
    for dst in (DST, DST_RUNS):
        msgpack.unpackb(conn.recv_bytes())  # P wrote and synchronized
        conn.send_bytes(msgpack.packb(_digest(cache, dst)))
    conn.recv_bytes()


def check_cuda_ipc(args, models) -> dict:
    """P opens D's exported cache and writes 512 blocks (1 GiB) layer by layer through the
    sender the prefill worker uses; D checks every byte landed."""
    if not on_gpu(args.device):
        return {"skipped": "needs a CUDA device"}
    from pdserve.kv_transfer.cuda_ipc import CudaIpcSender
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_ipc_decode, args=(there, args.device))
    proc.start()
    try:
        info = msgpack.unpackb(here.recv_bytes())
        cache = _cache(args.device, fill=True)
        sender = CudaIpcSender(cache, {"ipc": info})
        out: dict = {"block_mib": cache[:, :, 0].numel() * cache.element_size() / 2**20}
        for name, dst in (("one_copy_per_block", DST), ("contiguous_runs", DST_RUNS)):
            def push(dst: list[int] = dst) -> None:
                for layer in range(GEOM["layers"]):
                    sender.write_layer(layer, SRC, dst)
                sync(args.device)
            t = timed(push, args.device, reps=5)
            here.send_bytes(msgpack.packb(True))
            landed = msgpack.unpackb(here.recv_bytes())
            nbytes = len(SRC) * cache[:, :, 0].numel() * cache.element_size()
            out[name] = {"bytes": nbytes, "seconds": t, "gb_per_s": nbytes / t / 1e9,
                         "exact": landed == _digest(cache, SRC)}
            log(f"  cuda_ipc {name}: {out[name]}")
        buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=args.device)
        src = torch.empty_like(buf)
        out["same_process_d2d_copy_gb_per_s"] = nbytes / timed(lambda: buf.copy_(src), args.device) / 1e9
        here.send_bytes(b"bye")
        out["ok"] = all(out[k]["exact"] for k in ("one_copy_per_block", "contiguous_runs"))
        return out
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def _dist_rank(rank: int, init: str, backend: str, device: str, conn) -> None:
    try:
        from pdserve.kv_transfer.torch_dist import init_group
        import torch.distributed as dist
        if on_gpu(device):
            torch.cuda.set_device(device)
        init_group(backend, init, rank, 2, device)
        buf = torch.full((64 * 2**20,), float(rank + 1), device=device)  # 256 MiB of float32
        for _ in range(3):
            dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(5):
            dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0)
        sync(device)
        dt = (time.perf_counter() - t0) / 5
        ok = bool((buf == 1.0).all())
        dist.destroy_process_group()
        conn.send_bytes(msgpack.packb({"rank": rank, "ok": ok, "gb_per_s": buf.numel() * 4 / dt / 1e9}))
    except Exception as e:
        conn.send_bytes(msgpack.packb({"rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}))


def check_nccl(args, models) -> dict:
    """Two processes join a group over the backend the nccl transfer uses and move 256 MiB."""
    from pdserve.router.launch.local import free_port
    backend = "nccl" if on_gpu(args.device) else "gloo"
    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_dist_rank, args=(r, init, backend, args.device, pipes[r][1])) for r in range(2)]
    for p in procs:
        p.start()
    res = []
    for r in range(2):
        if pipes[r][0].poll(240):
            res.append(msgpack.unpackb(pipes[r][0].recv_bytes()))
        else:
            res.append({"rank": r, "ok": False, "error": "no answer in 240 s"})
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    args.nccl_ok = all(r["ok"] for r in res)
    return {"backend": backend, "ranks": res, "ok": args.nccl_ok}
