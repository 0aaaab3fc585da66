"""What moving a prompt's KV costs by path: shm on one host, tcp over loopback, tcp across
two network namespaces joined by a veth (a real interface, as between hosts), each tcp
path with and without CurveZMQ, side by side in one run.

    python -m benchmarks.kv_transfer.cost [--tokens 1024] [--reps 5] [--no-netns]
        [--out results/kv_transfer_cost.json]

The payload is `--tokens` tokens of KV in benchmarks/kv_transfer/bandwidth.py's geometry
(the small model's block: 8 layers x 4 kv heads x 64 dims, float32: 16 KiB per token).
tcp runs the workers' own code: a P process (transport Server, TcpSender: gather + one raw
frame behind KVReady) and a D process (transport Client, TcpReceiver: scatter into its
cache), HMAC-signed as in a deployment, Curve on or off; each pass is one PrefillRequest
answered, timed on D from the request to the last block scattered, and the last pass is
checked block for block. shm is kv_transfer_bandwidth's (P writes into D's mapped cache).

Reported per path: median seconds per payload, GB/s, and the TTFT a request pays per 1k
prompt tokens for its KV to move (the transfer runs after the prefill, before the first
token: ms per 1k tokens = 1024 x bytes per token / bandwidth), at this geometry and
scaled to a model's bytes per token; ratios: each path to shm, Curve to plain tcp on the
same network. The namespace pair needs root (`ip netns`); without it, or with
--no-netns, that network is left out and the report says so.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from benchmarks.harness.paths import REPO

import torch
import zmq

from benchmarks.harness.output import write_report
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.auth import DeploymentKey, read_secret_file
from pdserve.common.wire.messages import AbortRequest, KVReady, PrefillRequest
from pdserve.common.wire.transport import Client, Server
from benchmarks.kv_transfer.bandwidth import BLOCK_BYTES, GEOMETRY, WARMUP, bench_shm, kv_shape, source_cache

TOKENS_PER_BLOCK = GEOMETRY["block_size"]
BYTES_PER_TOKEN = BLOCK_BYTES // TOKENS_PER_BLOCK
# KV bytes per token of models people serve (2 x layers x kv heads x head dim x bytes), for the scaled column
MODELS = {"qwen3-0.6b bf16": 2 * 28 * 8 * 128 * 2, "llama-3.1-8b bf16": 2 * 32 * 8 * 128 * 2}
TIMEOUT_MS = 120_000


# ---- the two sides, as child processes ----------------------------------------------------

def child_p(bind: str, secret_file: str, curve: bool, blocks: int) -> None:
    """P: answer each PrefillRequest with KVReady and the blocks as one raw frame."""
    from pdserve.kv_transfer.tcp import TcpSender
    torch.set_num_threads(1)
    ctx = zmq.Context()
    server = Server(ctx, bind, key=DeploymentKey(read_secret_file(secret_file), curve))
    sender = TcpSender(source_cache(blocks), {})
    print(json.dumps({"address": server.address}), flush=True)
    while server.sock.poll(TIMEOUT_MS):
        inc = server.recv()
        if inc is None:
            continue
        if isinstance(inc.msg, AbortRequest):
            break
        ready = KVReady(inc.msg.request_id, 0, len(inc.msg.dst_block_ids))
        server.send(inc.identity, ready, sender.send(ready, list(range(blocks)), inc.msg.dst_block_ids))
    server.close()
    ctx.term()


def child_d(address: str, secret_file: str, curve: bool, blocks: int, reps: int) -> None:
    """D: request the payload WARMUP + reps times; seconds per pass and whether it landed."""
    from pdserve.kv_transfer.tcp import TcpReceiver
    torch.set_num_threads(1)
    cache = torch.zeros(kv_shape(blocks), dtype=torch.float32)
    receiver = TcpReceiver(cache)
    ctx = zmq.Context()
    client = Client(ctx, address, identity=b"bench-d", key=DeploymentKey(read_secret_file(secret_file), curve))
    dst, times = list(range(blocks)), []
    for i in range(WARMUP + reps):
        t0 = time.perf_counter()
        client.send(PrefillRequest(f"kv-{i}", "bench-d", [], SamplingParams(), 0, dst))
        inc = client.recv(timeout_ms=TIMEOUT_MS)
        receiver.receive(inc.msg, inc.frames, dst, {})
        times.append(time.perf_counter() - t0)
    verified = torch.equal(cache, source_cache(blocks))
    client.send(AbortRequest("done"))
    client.close()
    ctx.term()
    print(json.dumps({"times": times[WARMUP:], "verified": verified}), flush=True)


# ---- two network namespaces joined by a veth ------------------------------------------------

class VethPair:
    """Two namespaces (P's and D's) and a veth between them: the bytes cross a real
    interface, as between two hosts. `close` removes both."""

    def __init__(self) -> None:
        tag = f"kvc{os.getpid() % 100000}"
        self.ns = {"p": f"{tag}p", "d": f"{tag}d"}
        self.addr = {"p": "10.250.0.1", "d": "10.250.0.2"}
        try:
            for ns in self.ns.values():
                _ip("netns", "add", ns)
            _ip("link", "add", f"{tag}vp", "type", "veth", "peer", "name", f"{tag}vd")
            for side, ns in self.ns.items():
                dev = f"{tag}v{side}"
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{self.addr[side]}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except Exception:
            self.close()
            raise

    def prefix(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]]

    def close(self) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def spawn(prefix: list[str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-m", "benchmarks.kv_transfer.cost", *args], stdout=subprocess.PIPE, text=True, cwd=REPO)


def read_json(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise RuntimeError(f"benchmark child exited with {proc.wait()} (see stderr above)")
    return json.loads(line)


def bench_tcp(net: str, veth: VethPair | None, secret_file: str, curve: bool, blocks: int, reps: int) -> dict:
    p_prefix, d_prefix = (veth.prefix("p"), veth.prefix("d")) if veth else ([], [])
    host = veth.addr["p"] if veth else "127.0.0.1"
    flags = ["--secret-file", secret_file, "--blocks", str(blocks)] + (["--curve"] if curve else [])
    p = spawn(p_prefix, "--role", "p", "--bind", f"tcp://{host}:0", *flags)
    d = None
    try:
        address = read_json(p)["address"]
        d = spawn(d_prefix, "--role", "d", "--connect", address, "--reps", str(reps), *flags)
        res = read_json(d)
    finally:
        for proc in (d, p):
            if proc is not None:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    times = res["times"]
    return row(f"tcp {net}", curve, blocks * BLOCK_BYTES, statistics.median(times), min(times), len(times),
               res["verified"])


def row(path: str, curve: bool | None, nbytes: int, med: float, fastest: float, reps: int, verified: bool) -> dict:
    gbps = nbytes / med / 1e9
    per_1k = 1024 * BYTES_PER_TOKEN / (gbps * 1e9) * 1e3
    return {"path": path, "curve": curve, "bytes": nbytes, "reps": reps, "median_s": med, "min_s": fastest,
            "gbps": gbps, "ttft_ms_per_1k_tokens": per_1k, "verified": verified,
            "ttft_ms_per_1k_tokens_scaled": {m: 1024 * b / (gbps * 1e9) * 1e3 for m, b in MODELS.items()}}


def run(tokens: int, reps: int, netns: bool) -> dict:
    blocks = max(1, tokens // TOKENS_PER_BLOCK)
    nbytes = blocks * BLOCK_BYTES
    shm = bench_shm([nbytes])[0]  # contiguous destination blocks, as a fresh request's are
    rows = [row("shm", None, nbytes, shm["median_s"], shm["min_s"], shm["reps"], shm["verified"])]
    skipped = None
    veth = None
    if netns:
        try:
            veth = VethPair()
        except (OSError, subprocess.CalledProcessError) as e:
            why = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
            skipped = f"no namespace pair (needs root and `ip netns`: {why}); ran loopback only"
    with tempfile.TemporaryDirectory() as tmp:
        secret_file = Path(tmp) / "secret"
        secret_file.write_text(secrets.token_hex(32))
        secret_file.chmod(0o600)
        try:
            for net, pair in (("loopback", None), ("veth (two namespaces)", veth)):
                if net != "loopback" and pair is None:
                    continue
                for curve in (False, True):
                    rows.append(bench_tcp(net, pair, str(secret_file), curve, blocks, reps))
        finally:
            if veth is not None:
                veth.close()
    for r in rows:
        r["ratio_time_to_shm"] = r["median_s"] / rows[0]["median_s"]
        plain = next((p for p in rows if p["path"] == r["path"] and p["curve"] is False), None)
        if r["curve"] and plain is not None:
            r["curve_cost_ratio"] = r["median_s"] / plain["median_s"]
    return {"tokens": blocks * TOKENS_PER_BLOCK, "bytes_per_token": BYTES_PER_TOKEN, "geometry": GEOMETRY,
            "rows": rows, "netns_skipped": skipped, "torch_threads": 1, "cpu_count": os.cpu_count()}


def print_table(result: dict) -> None:
    print(f"KV of {result['tokens']} tokens ({result['tokens'] * result['bytes_per_token'] / 2**20:.0f} MiB, "
          f"{result['bytes_per_token'] // 1024} KiB/token)")
    print(f"{'path':28} {'curve':>5} {'median ms':>10} {'GB/s':>7} {'ms/1k tok':>10} {'x shm':>6} {'curve x':>8} ok")
    for r in result["rows"]:
        curve = "-" if r["curve"] is None else ("on" if r["curve"] else "off")
        cost = f"{r['curve_cost_ratio']:.2f}" if "curve_cost_ratio" in r else ""
        print(f"{r['path']:28} {curve:>5} {r['median_s'] * 1e3:10.2f} {r['gbps']:7.2f} "
              f"{r['ttft_ms_per_1k_tokens']:10.2f} {r['ratio_time_to_shm']:6.1f} {cost:>8} {r['verified']}")
    if result["netns_skipped"]:
        print(f"(veth: {result['netns_skipped']})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024, help="prompt tokens whose KV moves per pass")
    ap.add_argument("--reps", type=int, default=5, help="timed passes per path (after warm-up)")
    ap.add_argument("--no-netns", dest="netns", action="store_false", help="loopback and shm only")
    ap.add_argument("--out", default="results/kv_transfer_cost.json")
    ap.add_argument("--role", choices=["p", "d"], help=argparse.SUPPRESS)
    ap.add_argument("--bind", help=argparse.SUPPRESS)
    ap.add_argument("--connect", help=argparse.SUPPRESS)
    ap.add_argument("--secret-file", help=argparse.SUPPRESS)
    ap.add_argument("--curve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "p":
        child_p(args.bind, args.secret_file, args.curve, args.blocks)
        return 0
    if args.role == "d":
        child_d(args.connect, args.secret_file, args.curve, args.blocks, args.reps)
        return 0
    torch.set_num_threads(1)
    result = run(args.tokens, args.reps, args.netns)
    print_table(result)
    write_report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
