"""The output path's text work per streamed token, old vs new, side by side in one run.

    python benchmarks/output_path.py [--tokens 4096] [--repeats 3] [--model DIR]
        [--out results/output_path.json] [--serve [--serve-rounds 3] [--serve-requests 8]
        [--serve-tokens 512]]

(a) The detokenizer and stop checks alone.

One request's output of `--tokens` tokens (real prose: the repository's docs/*.md,
tokenized) with two stop strings that never match, fed one token at a time as a decode
worker produces them:

- OLD (commit 8da9e87): the router's `IncrementalDetokenizer.add` of that commit (loaded
  from `git show 8da9e87:router/detokenizer.py` into a temporary module: it decodes the
  whole output on every token), plus the engine's stop check of that commit on the
  worker (`tokenizer.decode(output)` and a `find` per stop string, per token).
- NEW: `common.text.detokenizer.IncrementalDetokenizer.add` (prefix/read offsets: a few
  tokens decoded per token; stop strings searched in the new text plus a held tail);
  the engine checks no text any more.

Both run on the real default model's tokenizer (SmolLM2-135M-Instruct, converted under
pdserve's cache) or, when it is absent, on a `make-model` tokenizer written to a
temporary folder. The two alternate, OLD then NEW, `--repeats` times; reported: each
repeat's wall and process-CPU seconds, the medians, microseconds per token and the
ratios old / new (target: new <= old / 10). Both must produce the same text.

(b) With --serve: the router's CPU per 1k streamed tokens of a colocated server, old vs
new. Two `pdserve serve --colocated 1` run at once on a `make-model` qwen3 tiny model
(random weights: fast tokens; the router's work per token does not depend on them):
the old one from `git archive 8da9e87` unpacked in a temporary folder, the new one from
this tree. Each round sends each server (order alternating) `--serve-requests`
concurrent streamed requests of `--serve-tokens` tokens (greedy, ignore_eos, the same
two never-matching stop strings) over ZeroMQ, speaking each server's protocol version,
and reads the serve process's own CPU time (utime + stime in /proc/PID/stat: the router
and its front ends; the worker is another process) before and after.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
from pathlib import Path
from typing import Callable

import msgpack
import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.common.text.detokenizer import IncrementalDetokenizer  # noqa: E402
from pdserve.common.text.tokenizer import Tokenizer  # noqa: E402

OLD_COMMIT = "8da9e87"
STOPS = ["<|never-here|>", "\n\nUser: stop"]


def old_detokenizer_class() -> type:
    """8da9e87's router/detokenizer.py IncrementalDetokenizer, from git, as a module."""
    source = subprocess.run(["git", "show", f"{OLD_COMMIT}:router/detokenizer.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("old_detokenizer")
    exec(compile(source, f"{OLD_COMMIT}:router/detokenizer.py", "exec"), module.__dict__)
    return module.IncrementalDetokenizer


def old_engine_check(tokenizer: Tokenizer, output: list[int], stop: list[str]) -> int | None:
    """8da9e87's LLMEngine.check_stop, its stop-string part (run on the worker per token)."""
    text = tokenizer.decode(output)
    hits = [text.find(s) for s in stop if s in text]
    return min(hits) if hits else None


def pick_model(arg: str) -> tuple[str, str, tempfile.TemporaryDirectory | None]:
    """(model folder, what it is, a temporary folder to clean up)."""
    if arg:
        return arg, "given", None
    from pdserve.common.loading.default_model import DEFAULT_NAME, cache_root
    real = cache_root() / DEFAULT_NAME
    if (real / "tokenizer.json").is_file():
        return str(real), DEFAULT_NAME, None
    from pdserve.common.loading.model_factory import make_model
    tmp = tempfile.TemporaryDirectory()
    make_model(tmp.name, "qwen3", "tiny", 0)
    return tmp.name, "make-model qwen3 tiny (the default model is not converted here)", tmp


def output_tokens(tok: Tokenizer, n: int) -> list[int]:
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tok.encode(text)
    while len(ids) < n:
        ids += ids
    return ids[:n]


def run_old(tok: Tokenizer, ids: list[int], detok_cls: type) -> str:
    detok = detok_cls(tok, STOPS)
    out: list[str] = []
    for i, t in enumerate(ids):
        if old_engine_check(tok, ids[:i + 1], STOPS) is not None:  # the worker's check, then the router's
            raise AssertionError("a stop string matched")
        out.append(detok.add([t], finished=i == len(ids) - 1))
    return "".join(out)


def run_new(tok: Tokenizer, ids: list[int]) -> str:
    detok = IncrementalDetokenizer(tok, STOPS)
    out = [detok.add([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]
    if detok.stopped:
        raise AssertionError("a stop string matched")
    return "".join(out)


def timed(fn: Callable[[], str]) -> tuple[float, float, str]:
    """(wall seconds, this process's CPU seconds, the text): CPU time is what other
    processes on a shared machine cannot inflate."""
    start, cpu = time.perf_counter(), time.process_time()
    text = fn()
    return time.perf_counter() - start, time.process_time() - cpu, text


# ---- (b) router CPU per 1k streamed tokens, old server vs new --------------------------

def start_serve(tree: Path, model_dir: str, workdir: Path) -> tuple[subprocess.Popen, dict]:
    """`pdserve serve --colocated 1` of the checkout at `tree`, ready: (process, ready file)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / "ready.json"
    cmd = [sys.executable, "-m", "pdserve", "serve", model_dir, "--colocated", "1", "--http-port", "0",
           "--zmq-port", "0", "--num-kv-blocks", "512", "--max-model-len", "2048", "--num-threads", "1",
           "--ready-file", str(ready)]
    log = open(workdir / "serve.log", "wb")
    proc = subprocess.Popen(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + 300
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server in {tree} did not start; see {workdir / 'serve.log'}")
        time.sleep(0.2)
    return proc, json.loads(ready.read_text())


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (not its children), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream_batch(address: str, version: int, n_requests: int, n_tokens: int) -> int:
    """`n_requests` concurrent streamed requests over raw ZeroMQ + msgpack; tokens received."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        open_ids = set()
        for i in range(n_requests):
            rid = uuid.uuid4().hex
            open_ids.add(rid)
            prompt = [5 + (7 * i + j) % 200 for j in range(24)]
            await sock.send(msgpack.packb({"v": version, "type": "submit", "data": {
                "request_id": rid, "prompt_token_ids": prompt, "stream": True,
                "sampling": {"temperature": 0.0, "max_tokens": n_tokens, "ignore_eos": True, "stop": STOPS}}}))
        tokens = 0
        while open_ids:
            if not await sock.poll(120_000):
                raise RuntimeError(f"no reply for 120 s; {len(open_ids)} requests open")
            msg = msgpack.unpackb(await sock.recv())
            data = msg["data"]
            if msg["type"] == "error":
                raise RuntimeError(f"server error: {data}")
            tokens += len(data["token_ids"])
            if data["finished"]:
                if data["finish_reason"] != "length":
                    raise RuntimeError(f"request ended with {data['finish_reason']!r}, expected 'length'")
                open_ids.discard(data["request_id"])
        return tokens
    finally:
        sock.close(0)
        ctx.term()


def serve_benchmark(args: argparse.Namespace) -> dict:
    from pdserve.common.loading.model_factory import make_model
    with tempfile.TemporaryDirectory(prefix="output-path-serve-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = str(make_model(tmp / "model", "qwen3", "tiny", 0))
        old_tree = tmp / "old"
        old_tree.mkdir()
        archive = subprocess.run(["git", "archive", OLD_COMMIT], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive, check=True)
        from pdserve.common.wire.messages import PROTOCOL_VERSION
        servers = {"old": (old_tree, 1), "new": (ROOT, PROTOCOL_VERSION)}
        procs: dict[str, tuple[subprocess.Popen, dict]] = {}
        per_1k: dict[str, list[float]] = {"old": [], "new": []}
        try:
            for name, (tree, _) in servers.items():
                procs[name] = start_serve(tree, model_dir, tmp / f"run-{name}")
            for name, (_, version) in servers.items():  # warm-up, untimed
                asyncio.run(stream_batch(procs[name][1]["zmq"], version, 2, 16))
            for r in range(args.serve_rounds):
                order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
                for name in order:
                    proc, info = procs[name]
                    before = cpu_seconds(proc.pid)
                    tokens = asyncio.run(stream_batch(info["zmq"], servers[name][1], args.serve_requests,
                                                      args.serve_tokens))
                    per_1k[name].append((cpu_seconds(proc.pid) - before) / tokens * 1000)
                    print(f"  round {r} {name}: {tokens} tokens, router CPU {per_1k[name][-1] * 1e3:.1f} ms "
                          f"per 1k tokens", flush=True)
        finally:
            for proc, _ in procs.values():
                proc.send_signal(signal.SIGTERM)
            for proc, _ in procs.values():
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    old_med, new_med = statistics.median(per_1k["old"]), statistics.median(per_1k["new"])
    print(f"router CPU per 1k streamed tokens: old {old_med * 1e3:.1f} ms, new {new_med * 1e3:.1f} ms, "
          f"old/new = {old_med / new_med:.2f}x")
    return {"model": "make-model qwen3 tiny", "requests": args.serve_requests, "tokens_per_request": args.serve_tokens,
            "rounds": args.serve_rounds, "old_cpu_s_per_1k_tokens": per_1k["old"],
            "new_cpu_s_per_1k_tokens": per_1k["new"], "old_median": old_med, "new_median": new_med,
            "ratio_old_over_new": old_med / new_med}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="", help="a model folder (default: the real default model, else make-model)")
    ap.add_argument("--out", default=str(ROOT / "results" / "output_path.json"))
    ap.add_argument("--serve", action="store_true", help="also (b): router CPU per 1k tokens, old server vs new")
    ap.add_argument("--serve-rounds", type=int, default=3)
    ap.add_argument("--serve-requests", type=int, default=8)
    ap.add_argument("--serve-tokens", type=int, default=512)
    args = ap.parse_args()
    model_dir, what, tmp = pick_model(args.model)
    try:
        tok = Tokenizer(model_dir)
        ids = output_tokens(tok, args.tokens)
        expected = tok.decode(ids)
        if any(s in expected for s in STOPS):
            raise SystemExit("a stop string occurs in the benchmark text: pick others")
        old_cls = old_detokenizer_class()
        old_s: list[float] = []
        new_s: list[float] = []
        old_cpu: list[float] = []
        new_cpu: list[float] = []
        for _ in range(args.repeats):
            t_old, c_old, text_old = timed(lambda: run_old(tok, ids, old_cls))
            t_new, c_new, text_new = timed(lambda: run_new(tok, ids))
            if not text_old == text_new == expected:
                raise AssertionError("old and new text differ")
            old_s.append(t_old)
            new_s.append(t_new)
            old_cpu.append(c_old)
            new_cpu.append(c_new)
    finally:
        if tmp is not None:
            tmp.cleanup()
    old_med, new_med = statistics.median(old_s), statistics.median(new_s)
    result = {
        "tokenizer": what, "model_dir": model_dir, "tokens": len(ids), "chars": len(expected), "stop": STOPS,
        "repeats": args.repeats, "old_commit": OLD_COMMIT,
        "old_s": old_s, "new_s": new_s, "old_median_s": old_med, "new_median_s": new_med,
        "old_us_per_token": old_med / len(ids) * 1e6, "new_us_per_token": new_med / len(ids) * 1e6,
        "ratio_old_over_new": old_med / new_med, "target_met": new_med <= old_med / 10,
        "old_cpu_s": old_cpu, "new_cpu_s": new_cpu,
        "cpu_ratio_old_over_new": statistics.median(old_cpu) / statistics.median(new_cpu),
    }
    print(f"tokenizer: {what}; {len(ids)} tokens ({len(expected)} chars), stop strings {STOPS!r} (never matching)")
    for i, (o, n, co, cn) in enumerate(zip(old_s, new_s, old_cpu, new_cpu)):
        print(f"  repeat {i}: old {o * 1e3:9.1f} ms   new {n * 1e3:7.1f} ms   ratio {o / n:7.1f}x"
              f"   (CPU: old {co * 1e3:9.1f} ms, new {cn * 1e3:7.1f} ms, ratio {co / cn:7.1f}x)")
    print(f"median: old {old_med * 1e3:.1f} ms ({result['old_us_per_token']:.1f} us/token), "
          f"new {new_med * 1e3:.1f} ms ({result['new_us_per_token']:.2f} us/token), "
          f"old/new = {result['ratio_old_over_new']:.1f}x (target >= 10x: {'met' if result['target_met'] else 'MISSED'}); "
          f"CPU time old/new = {result['cpu_ratio_old_over_new']:.1f}x")
    if args.serve:
        result["serve"] = serve_benchmark(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
