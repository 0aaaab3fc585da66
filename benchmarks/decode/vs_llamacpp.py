"""pdserve against llama.cpp on the same GGUF file, decode at batch 1 and batch 8, one run.

    python -m benchmarks.decode.vs_llamacpp --llama-python /work/llama-venv/bin/python
        [--gguf FILE] [--threads 1] [--tokens 32] [--rounds 3] [--out results/vs_llamacpp.json]

llama.cpp runs through `llama-cpp-python` (PyPI; a source package that compiles llama.cpp
on install, ~10-40 minutes on 2 cores) in its own venv, in a child process driven over
stdin/stdout; pdserve runs the same file in this process (`--quantization auto`: a GGUF's
Q4_1 / Q8_0 linears kept as stored). Both use `--threads` threads. The two engines take
turns round by round. A round, for each batch size B in (1, 8):

- B sequences, each a different 32-token prompt (token ids, the same for both engines),
  are prefilled; then `--tokens` greedy decode steps, each one token per sequence;
- the figure is milliseconds per decode step (the prefill not counted; pdserve's from its
  engine's own step timing, llama.cpp's around `llama_decode` + the argmax of each
  sequence's logits) and tokens/s = B / step time.

Reported: each engine's median over rounds, and llama.cpp's step time over pdserve's
(above 1: pdserve is faster). Default file: the embedded SmolLM2-135M-Instruct Q4_1.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.harness.child import JsonChild
from benchmarks.harness.paths import REPO

BATCHES = (1, 8)
PROMPT_LEN = 32

LLAMA_CHILD = r"""
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
path, threads = sys.argv[1], int(sys.argv[2])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, n_batch=512, verbose=False)
params = llm.context_params  # a second context that holds 8 sequences (Llama's own holds one)
params.n_seq_max, params.n_ctx, params.kv_unified = 8, 4096, True
ctx, n_vocab = llama_cpp.llama_init_from_model(llm._model.model, params), llm.n_vocab()
mem = llama_cpp.llama_get_memory(ctx)

def decode(entries):
    batch = llama_cpp.llama_batch_init(len(entries), 0, 8)
    for i, (tok, pos, seq, want) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, want
    batch.n_tokens = len(entries)
    rc = llama_cpp.llama_decode(ctx, batch)
    llama_cpp.llama_batch_free(batch)
    assert rc == 0, rc

def argmax(i):
    return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    prompts, tokens = job["prompts"], job["tokens"]
    llama_cpp.llama_memory_clear(mem, True)
    entries = [(t, p, s, int(p == len(pr) - 1)) for s, pr in enumerate(prompts) for p, t in enumerate(pr)]
    decode(entries)
    last = [argmax(i) for i, e in enumerate(entries) if e[3]]
    steps = []
    for step in range(tokens):
        t0 = time.perf_counter()
        decode([(tok, len(prompts[s]) + step, s, 1) for s, tok in enumerate(last)])
        last = [argmax(i) for i in range(len(prompts))]
        steps.append(time.perf_counter() - t0)
    print(json.dumps({"step_ms": sum(steps) / len(steps) * 1000}), flush=True)
"""


class LlamaCpp(JsonChild):
    """llama.cpp in a child process of the venv that has llama-cpp-python."""

    def __init__(self, python: str, gguf: Path, threads: int) -> None:
        super().__init__(python, LLAMA_CHILD, [str(gguf), str(threads)], threads)

    def step_ms(self, prompts: list[list[int]], tokens: int) -> float:
        return self.ask({"prompts": prompts, "tokens": tokens})["step_ms"]


def pdserve_step_ms(llm, prompts: list[list[int]], tokens: int) -> float:
    """Mean time of the decode steps after every sequence has its first token."""
    from pdserve.common import SamplingParams
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True, temperature=0)
    seqs = [engine.new_sequence(p, params) for p in prompts]
    for seq in seqs:
        engine.add(seq)
    stamps = []
    while engine.has_work():
        engine.step()
        stamps.append((time.perf_counter(), min(len(s.output_token_ids) for s in seqs)))
    first = next(i for i, (_, n) in enumerate(stamps) if n >= 1)
    return (stamps[-1][0] - stamps[first][0]) / (len(stamps) - 1 - first) * 1000


def prompts_for(batch: int, vocab: int) -> list[list[int]]:
    return [[(97 * s + 31 * j) % (vocab - 100) + 50 for j in range(PROMPT_LEN)] for s in range(batch)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python")
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "results" / "vs_llamacpp.json"))
    args = ap.parse_args()
    from benchmarks.harness.facts import run_facts
    from benchmarks.harness.output import write_report
    from pdserve.common import LLM
    from pdserve.common.loading.default_model import default_gguf
    gguf = Path(args.gguf) if args.gguf else default_gguf()
    ours = LLM(str(gguf), num_threads=args.threads, num_kv_blocks=256, max_model_len=512, quantization="auto")
    theirs = LlamaCpp(args.llama_python, gguf, args.threads)
    vocab = ours.engine.config.model.vocab_size
    runs: dict[str, dict[int, list[float]]] = {"pdserve": {b: [] for b in BATCHES}, "llama.cpp": {b: [] for b in BATCHES}}
    try:
        pdserve_step_ms(ours, prompts_for(1, vocab), 4)  # warm-ups
        theirs.step_ms(prompts_for(1, vocab), 4)
        for _ in range(args.rounds):
            for b in BATCHES:
                prompts = prompts_for(b, vocab)
                runs["pdserve"][b].append(pdserve_step_ms(ours, prompts, args.tokens))
                runs["llama.cpp"][b].append(theirs.step_ms(prompts, args.tokens))
    finally:
        theirs.close()
    med = {eng: {b: statistics.median(v) for b, v in per.items()} for eng, per in runs.items()}
    report = {**run_facts(), "gguf": str(gguf), "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
              "pdserve_quantization": ours.engine.config.device.quantization,
              "step_ms_median": {e: {str(b): v for b, v in per.items()} for e, per in med.items()},
              "llamacpp_over_pdserve": {str(b): med["llama.cpp"][b] / med["pdserve"][b] for b in BATCHES},
              "runs": {e: {str(b): v for b, v in per.items()} for e, per in runs.items()}}
    for b in BATCHES:
        p, llama = med["pdserve"][b], med["llama.cpp"][b]
        print(f"batch {b}: pdserve {p:.2f} ms/step ({b / p * 1000:.1f} tok/s), llama.cpp {llama:.2f} ms/step "
              f"({b / llama * 1000:.1f} tok/s); llama.cpp / pdserve {llama / p:.2f}")
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
