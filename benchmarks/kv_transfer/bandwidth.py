"""Part (a) of benchmarks/kv_transfer/run.py: KV bandwidth of each CPU backend (shm, tcp,
gloo) between two real processes, next to a single-thread memcpy timed before, between
and after them. Owns the payload geometry, the child processes that play P and D (run as
`kv_transfer.py --role ...`, which dispatches back here) and the bandwidth rows of the
report. Imported by the script, which puts the repository root on sys.path first.
"""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time

import torch
import zmq

from pdserve.router.launch.local import free_port
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.messages import AbortRequest, KVReady, PrefillRequest
from pdserve.common.wire.transport import Client, Server

from benchmarks.harness.paths import REPO

ENTRY = "benchmarks.kv_transfer.run"  # the children's entry point (python -m, from the repository root)

# Bandwidth payload geometry: the small model's block (16 tokens x 4 kv heads x 64 dims,
# float32) with 8 layers, so one block is 2*8*16*4*64*4 B = 256 KiB and every MiB size is
# a whole number of blocks. Per-layer copy sizes match the small model's.
GEOMETRY = dict(layers=8, block_size=16, kv_heads=4, head_dim=64)
DTYPE = torch.float32
BLOCK_BYTES = 2 * GEOMETRY["layers"] * GEOMETRY["block_size"] * GEOMETRY["kv_heads"] * GEOMETRY["head_dim"] * 4
WARMUP = 2
CPU_BACKENDS = ("shm", "tcp", "gloo")
RECV_TIMEOUT_MS = 300_000  # how long either side waits for its peer (also part b)


def kv_shape(num_blocks: int) -> tuple[int, ...]:
    g = GEOMETRY
    return (2, g["layers"], num_blocks, g["block_size"], g["kv_heads"], g["head_dim"])


def source_cache(num_blocks: int) -> torch.Tensor:
    """P's cache contents: reproducible in any process, different in every block, so D
    can check that the right source block landed in each destination block."""
    shape = kv_shape(num_blocks)
    return torch.arange(math.prod(shape), dtype=DTYPE).view(shape)


def reps_for(nbytes: int) -> int:
    """Timed passes per size: ~1 GiB moved in all, at least 5 and at most 30 passes."""
    return max(5, min(30, (1 << 30) // nbytes))


def summarize(times: list[float], nbytes: int) -> dict:
    med = statistics.median(times)
    return {"reps": len(times), "median_s": med, "min_s": min(times), "max_s": max(times),
            "gbps": nbytes / med / 1e9}


# ---- child processes (P and D sides of a real transfer) ------------------------------

def spawn(role: str, *args: str, stdin: bool = False) -> subprocess.Popen:
    """This script again as a child process; it speaks one JSON object per stdout line."""
    cmd = [sys.executable, "-m", ENTRY, "--role", role, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.PIPE if stdin else None,
                            text=True, cwd=REPO)


def read_json(proc: subprocess.Popen) -> dict | list:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise RuntimeError(f"benchmark child {proc.args[3:5]} exited with code {proc.wait()} (see stderr above)")
    return json.loads(line)


def emit(obj: dict | list) -> None:
    print(json.dumps(obj), flush=True)


def child_shm_p(peer_info: dict) -> None:
    """P side of shm: map D's cache, then per command time write_layer over all layers."""
    from pdserve.kv_transfer.shm import ShmSender
    torch.set_num_threads(1)
    sender = ShmSender(source_cache(peer_info["shape"][2]), peer_info)
    for line in sys.stdin:
        cmd = json.loads(line)
        before = sender.bytes_sent
        times, cpu_times = [], []
        for _ in range(cmd["passes"]):
            t0, c0 = time.perf_counter(), time.thread_time()
            for layer in range(GEOMETRY["layers"]):
                sender.write_layer(layer, cmd["src"], cmd["dst"])
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.thread_time() - c0)
        emit({"times": times, "cpu_times": cpu_times, "bytes_per_pass": (sender.bytes_sent - before) // cmd["passes"]})
    sender.close()


def child_pair_p(backend: str, plan: list[dict], dist_init: str) -> None:
    """P side of tcp / gloo: answer each PrefillRequest with KVReady plus the payload."""
    torch.set_num_threads(1)
    cache = source_cache(max(step["n"] for step in plan))
    ctx = zmq.Context()
    server = Server(ctx, "tcp://127.0.0.1:0")
    emit({"address": server.address})
    if backend == "gloo":
        from pdserve.kv_transfer.torch_dist import DistSender, init_group
        init_group("gloo", dist_init, 0, 2)
        sender = DistSender(cache, {"rank": 1}, "gloo")
    else:
        from pdserve.kv_transfer.tcp import TcpSender
        sender = TcpSender(cache, {})
    while True:
        if not server.sock.poll(RECV_TIMEOUT_MS):
            raise TimeoutError("the D side of the benchmark went silent")
        inc = server.recv()
        if inc is None:
            continue
        if isinstance(inc.msg, AbortRequest):  # D is done
            break
        req: PrefillRequest = inc.msg
        ready = KVReady(req.request_id, 0, len(req.dst_block_ids), timeline={"transfer_start": time.monotonic()})
        frames = sender.send(ready, list(range(len(req.dst_block_ids))), req.dst_block_ids)
        ready.timeline["send_returned"] = time.monotonic()  # gathered (and isend posted)
        server.send(inc.identity, ready, frames)
        sender.poll()
    sender.close()
    server.close()
    ctx.term()
    if backend == "gloo":
        torch.distributed.destroy_process_group()


def child_pair_d(backend: str, plan: list[dict], address: str, dist_init: str) -> None:
    """D side of tcp / gloo: request each payload, receive and scatter it, time it."""
    torch.set_num_threads(1)
    num_blocks = max(step["n"] for step in plan)
    cache = torch.zeros(kv_shape(num_blocks), dtype=DTYPE)
    if backend == "gloo":
        from pdserve.kv_transfer.torch_dist import DistReceiver, init_group
        init_group("gloo", dist_init, 1, 2)
        receiver, peer = DistReceiver(cache, "gloo"), {"rank": 0}
    else:
        from pdserve.kv_transfer.tcp import TcpReceiver
        receiver, peer = TcpReceiver(cache), {}
    expected = source_cache(num_blocks)
    ctx = zmq.Context()
    client = Client(ctx, address, identity=b"bench-d")
    results = []
    for step in plan:
        n, passes = step["n"], step["passes"]
        blocks = list(range(n))
        total, p_side, d_side = [], [], []
        for i in range(passes):
            if i == passes - 1:
                cache[:, :, :n].zero_()  # the check below must see this pass's data
            client.send(PrefillRequest(f"bench-{n}-{i}", "bench-d", [], SamplingParams(), 0, blocks))
            inc = client.recv(timeout_ms=RECV_TIMEOUT_MS)
            arrived = time.monotonic()
            pending = receiver.receive(inc.msg, inc.frames, blocks, peer)
            if pending is not None:  # gloo: the irecv completes in the background
                while not pending.done():
                    time.sleep(0.0002)
                pending.land()
            done = time.monotonic()
            tl = inc.msg.timeline
            total.append(done - tl["transfer_start"])
            p_side.append(tl["send_returned"] - tl["transfer_start"])
            d_side.append(done - arrived)
        ok = torch.equal(cache[:, :, :n], expected[:, :, :n])
        results.append({"n": n, "times": total, "p_gather_send_s": p_side, "d_receive_scatter_s": d_side,
                        "verified": ok})
    client.send(AbortRequest("bench-done"))
    emit(results)
    client.close()
    ctx.term()
    if backend == "gloo":
        torch.distributed.destroy_process_group()


# ---- (a) bandwidth ------------------------------------------------------------------

def bench_memcpy(sizes: list[int]) -> dict[int, dict[str, list[float]]]:
    """Single-thread copy of one payload-sized tensor into another (both pre-faulted);
    wall seconds and this thread's CPU seconds per pass."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for nbytes in sizes:
            src = torch.ones(nbytes // 4, dtype=DTYPE)
            dst = torch.zeros_like(src)
            wall, cpu = [], []
            for i in range(WARMUP + reps_for(nbytes)):
                t0, c0 = time.perf_counter(), time.thread_time()
                dst.copy_(src)
                t1, c1 = time.perf_counter(), time.thread_time()
                if i >= WARMUP:
                    wall.append(t1 - t0)
                    cpu.append(c1 - c0)
            out[nbytes] = {"wall": wall, "cpu": cpu}
    finally:
        torch.set_num_threads(threads)
    return out


def bench_shm(sizes: list[int]) -> list[dict]:
    from pdserve.kv_transfer.shm import ShmReceiver
    num_blocks = max(sizes) // BLOCK_BYTES
    receiver = ShmReceiver(kv_shape(num_blocks), DTYPE, "kvbench")
    expected = source_cache(num_blocks)
    child = spawn("shm-p", "--peer-info", json.dumps(receiver.backend_info()), stdin=True)
    rows = []
    try:
        for order in ("contiguous", "reversed"):
            for nbytes in sizes:
                n = nbytes // BLOCK_BYTES
                src = list(range(n))
                dst = src if order == "contiguous" else src[::-1]
                receiver.kv_cache[:, :, :n].zero_()
                passes = WARMUP + reps_for(nbytes)
                child.stdin.write(json.dumps({"src": src, "dst": dst, "passes": passes}) + "\n")  # type: ignore[union-attr]
                child.stdin.flush()  # type: ignore[union-attr]
                reply = read_json(child)
                ok = torch.equal(receiver.kv_cache.index_select(2, torch.tensor(dst)),
                                 expected.index_select(2, torch.tensor(src)))
                rows.append({"backend": "shm", "variant": f"{order} dst blocks", "bytes": nbytes,
                             "first_s": reply["times"][0], **summarize(reply["times"][WARMUP:], nbytes),
                             "cpu_median_s": statistics.median(reply["cpu_times"][WARMUP:]),
                             "verified": ok, "bytes_counted_by_sender": reply["bytes_per_pass"]})
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(60)
        receiver.close()
    return rows


def bench_pair(backend: str, sizes: list[int]) -> list[dict]:
    plan = [{"n": nbytes // BLOCK_BYTES, "passes": WARMUP + reps_for(nbytes)} for nbytes in sizes]
    dist_init = f"tcp://127.0.0.1:{free_port()}" if backend == "gloo" else ""
    common_args = ["--backend", backend, "--plan", json.dumps(plan), "--dist-init", dist_init]
    p = spawn("pair-p", *common_args)
    d = None
    try:
        address = read_json(p)["address"]
        d = spawn("pair-d", *common_args, "--address", address)
        results = read_json(d)
        d.wait(60)
        p.wait(60)
    finally:
        for proc in (d, p):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    rows = []
    for nbytes, res in zip(sizes, results):
        rows.append({"backend": backend, "variant": "gather + send + scatter", "bytes": nbytes,
                     "first_s": res["times"][0], **summarize(res["times"][WARMUP:], nbytes),
                     "verified": res["verified"],
                     "p_gather_send_median_s": statistics.median(res["p_gather_send_s"][WARMUP:]),
                     "d_receive_scatter_median_s": statistics.median(res["d_receive_scatter_s"][WARMUP:])})
    return rows


def run_bandwidth(sizes: list[int]) -> tuple[list[dict], list[dict]]:
    """memcpy runs before, between and after the backends; each backend's ratio uses the
    memcpy passes taken just before and just after it, so load drift on a shared machine
    hits both sides of the ratio alike."""
    memcpy = [bench_memcpy(sizes)]
    rows = []
    for bench in (bench_shm, lambda s: bench_pair("tcp", s), lambda s: bench_pair("gloo", s)):
        backend_rows = bench(sizes)
        memcpy.append(bench_memcpy(sizes))
        for row in backend_rows:
            around = memcpy[-2][row["bytes"]], memcpy[-1][row["bytes"]]
            wall = statistics.median(around[0]["wall"] + around[1]["wall"])
            row["memcpy_median_s"] = wall
            row["ratio_to_memcpy"] = wall / row["median_s"]
            if "cpu_median_s" in row:
                row["ratio_to_memcpy_cpu"] = statistics.median(around[0]["cpu"] + around[1]["cpu"]) / row["cpu_median_s"]
        rows += backend_rows
    memcpy_rows = []
    for nbytes in sizes:
        wall = [t for m in memcpy for t in m[nbytes]["wall"]]
        memcpy_rows.append({"backend": "memcpy", "variant": "1 thread, copy_", "bytes": nbytes, **summarize(wall, nbytes),
                            "cpu_median_s": statistics.median(t for m in memcpy for t in m[nbytes]["cpu"]),
                            "median_per_run_s": [statistics.median(m[nbytes]["wall"]) for m in memcpy],
                            "ratio_to_memcpy": 1.0, "ratio_to_memcpy_cpu": 1.0})
    return memcpy_rows, rows
