"""The output path's text work per streamed token, old vs new, side by side in one run.

    python benchmarks/output_path.py [--tokens 4096] [--repeats 3] [--model DIR]
        [--out results/output_path.json]

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
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.text.detokenizer import IncrementalDetokenizer  # noqa: E402
from common.text.tokenizer import Tokenizer  # noqa: E402

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
    from common.loading.default_model import DEFAULT_NAME, cache_root
    real = cache_root() / DEFAULT_NAME
    if (real / "tokenizer.json").is_file():
        return str(real), DEFAULT_NAME, None
    from common.loading.model_factory import make_model
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="", help="a model folder (default: the real default model, else make-model)")
    ap.add_argument("--out", default=str(ROOT / "results" / "output_path.json"))
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
