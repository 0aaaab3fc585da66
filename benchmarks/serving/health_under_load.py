"""/health latency while a burst of streamed completions hits the router: what a load
balancer's health check sees under load. Against a running `pdserve serve` (--url), or one
it starts on a tiny random model (default). Prints p50/p99/max of /health and the burst's
outcome (200s, 429s, anything else), and writes the numbers as JSON.

    python -m benchmarks.serving.health_under_load --requests 300 --max-tokens 8 --out health.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness.models import make_if_missing
from benchmarks.harness.servers import start_pdserve



async def _stream(http: httpx.AsyncClient, url: str, max_tokens: int, i: int) -> str:
    body = {"prompt": f"Request {i} asks the router for", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return str(resp.status_code)
            async for line in resp.aiter_lines():
                if line.startswith("data: {\"error\""):
                    return "stream_error"
            return "200"
    except httpx.HTTPError as e:
        return type(e).__name__


def _poll_health(url: str, stop, every_s: float, out) -> None:
    """In its own process (spawned): the burst's client must not delay the probes it times."""
    lat = []
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            http.get(f"{url}/health")
            lat.append(time.perf_counter() - t0)
            time.sleep(every_s)
    out.put(lat)


async def measure(url: str, requests: int, max_tokens: int, every_s: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    poller = ctx.Process(target=_poll_health, args=(url, stop, every_s, out), daemon=True)
    poller.start()
    time.sleep(1.0)  # the poller's imports, before the burst
    limits = httpx.Limits(max_connections=requests + 8, max_keepalive_connections=requests + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(_stream(http, url, max_tokens, i) for i in range(requests)))
        wall = time.perf_counter() - t0
    stop.set()
    lat = sorted(out.get(timeout=60))
    poller.join(10)
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3

    return {"requests": requests, "max_tokens": max_tokens, "burst_s": wall, "outcomes": counts,
            "health_samples": len(lat), "health_p50_ms": pct(0.5), "health_p99_ms": pct(0.99),
            "health_max_ms": lat[-1] * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="http://host:port of a running server (default: start one)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--every-ms", type=float, default=20.0)
    ap.add_argument("--max-inflight", type=int, default=0, help="for the server started here (0: its default)")
    ap.add_argument("--out", default="health_under_load.json")
    args = ap.parse_args()
    served = None
    url = args.url
    if url is None:
        work = Path(tempfile.mkdtemp(prefix="health_bench_"))
        model = make_if_missing(work / "qwen3", "tiny", seed=1)
        extra = ["--max-inflight", str(args.max_inflight)] if args.max_inflight else []
        served = start_pdserve("1p1d", str(model), work, extra)
        url = served.url
    try:
        res = asyncio.run(measure(url.rstrip("/").removesuffix("/v1"), args.requests, args.max_tokens,
                                  args.every_ms / 1e3))
    finally:
        if served is not None:
            served.stop()
    print(f"{res['requests']} streams x {res['max_tokens']} tokens in {res['burst_s']:.1f} s: {res['outcomes']}")
    print(f"/health over {res['health_samples']} probes: p50 {res['health_p50_ms']:.1f} ms, "
          f"p99 {res['health_p99_ms']:.1f} ms, max {res['health_max_ms']:.1f} ms")
    Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
