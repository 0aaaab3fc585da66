"""Speculative decoding against none, side by side in one process (issue 51).

    python -m benchmarks.decode.spec_decode [--model DIR] [--threads 2] [--tokens 96] [--rounds 3]
        [--k 4] [--streams 8] [--stream-rounds 9] [--gguf] [--llama-python PY] [--out results/spec_decode.json]

One engine per configuration, all on the same model (default: the embedded
SmolLM2-135M-Instruct at float32, `--quantization none`), taking turns request by request:

- off: no speculation;
- self_int4: `{"method": "draft_model", "model": "self", "quantization": "int4"}`, the
  model's own int4 copy drafting;
- ngram: `{"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}`;

each with `num_speculative_tokens` = --k and the adaptive policy on (the default); with
`--configs` also the same two with `"adaptive": false` (every step verifies what the
proposer has: self_int4_fixed, ngram_fixed).

Two prompt sets, chat-templated: `repeat`, asks whose answer repeats much of the prompt
(edit this code, repeat this text with one change); `chat`, open questions. Single
stream: each prompt alone, greedy, up to --tokens tokens; its per-token time is (last
token - first token) / (tokens - 1) from the engine's own steps (the prompt's prefill is
not counted), and a set's figure is its total decode time over its total tokens, the
median of --rounds rounds, in wall time and in CPU time of the engine's thread (on a host
whose cores other jobs share, the second says what the steps cost without the time the
cores were taken away). Every configuration's output must equal off's token for token
(greedy, float32: speculation changes no token); a difference is reported and fails the
run. Acceptance length: 1 + accepted / verifications (vLLM's mean acceptance length), and
the share of steps that verified drafts.

Concurrent: --streams chat prompts at once in one engine (continuous batching): per-stream
time per token, the mean over the streams, over --stream-rounds rounds after the single-stream
ones (each round runs every configuration once, the order rotated round by round so that no
configuration always follows the same one). A step of 8 rows costs what it computes, and
this VM's rounds vary by ~10% (CPU time too), so besides the ratio of medians each
configuration gets its rounds' paired ratios (off's ms over its ms in the same round): their
median and a 95% percentile-bootstrap interval of that median.

The same GGUF (`--gguf`, implied by `--llama-python`; the embedded SmolLM2's Q4_1 file):
pdserve with its quantized linears kept (`--quantization auto`) plain (gguf_off) and with
`ngram` (gguf_ngram), compared with gguf_off; and with `--llama-python` (the python of a venv
with `llama-cpp-python`), llama.cpp on that file in a child process, single stream, plain
(llamacpp_off) and with its prompt-lookup decoding (llamacpp_lookup:
`LlamaPromptLookupDecoding(max_ngram_size=4, num_pred_tokens=--k)`), greedy, the same
prompt token ids, the same per-token rule (first to last generated token), compared with
llamacpp_off. Where its lookup output differs from its plain output (llama.cpp's own batch
numerics), that is recorded (`peer_mismatches`), not a failure of the run.

Targets (issue 51): self_int4 >= 2x off's speed on chat; ngram >= 1.5x on repeat and >= 0.95x
on chat; every configuration >= 0.95x off at --streams streams.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from benchmarks.harness.child import JsonChild
from benchmarks.harness.facts import run_facts
from benchmarks.harness.output import write_report
from benchmarks.harness.paths import RESULTS
from pdserve.common import LLM, SamplingParams
from pdserve.router.stats.intervals import bootstrap_percentiles

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax


def average_price(items):
    if not items:
        return 0
    return sum(item["price"] for item in items) / len(items)
'''
TEXT = ("The library opens at nine in the morning and closes at six in the evening. Visitors may borrow up to "
        "five books at a time for three weeks. Books can be renewed once online or at the front desk. Late "
        "returns cost ten cents per day per book. The reading room on the second floor is quiet and has free "
        "wireless internet.")
PROMPTS = {
    "repeat": [
        f"Rename the function total_price to compute_total in this code and return the whole code:\n\n{CODE}",
        f"Add a docstring to each function in this code and return the whole code:\n\n{CODE}",
        f"Repeat the following text exactly, but write 'ten' instead of 'nine':\n\n{TEXT}",
        f"Copy this text, word for word:\n\n{TEXT}",
    ],
    "chat": [
        "Tell me a short story about a dragon who learns to cook.",
        "Explain how a rainbow forms.",
        "What are three tips for learning a new language?",
        "Describe a perfect day at the beach.",
    ],
}
CHAT_MORE = ["Why is the sky blue?", "Write a poem about autumn leaves.", "How do airplanes stay in the air?",
             "Give me a recipe for pancakes."]  # with PROMPTS["chat"], the concurrent streams


def configs(k: int) -> dict[str, dict | None]:
    draft = {"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": k}
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    return {"off": None, "self_int4": draft, "ngram": ngram,  # the default set
            "self_int4_fixed": {**draft, "adaptive": False}, "ngram_fixed": {**ngram, "adaptive": False}}


DEFAULT_CONFIGS = "off,self_int4,ngram"  # each engine holds its weights (and a draft its own): ~1.5 GB apiece


LLAMA_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
path, threads, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
opts = dict(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, verbose=False)
llms = {"llamacpp_off": Llama(**opts),
        "llamacpp_lookup": Llama(**opts, draft_model=LlamaPromptLookupDecoding(max_ngram_size=4, num_pred_tokens=k))}
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    llm = llms[job["name"]]
    llm.reset()
    out, stamps = [], []
    for tok in llm.generate(job["prompt"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        stamps.append((time.perf_counter(), time.process_time()))
        if tok == llm.token_eos() or len(out) == job["tokens"]:
            break
        out.append(tok)
    print(json.dumps({"tokens": [out], "n": [len(out)], "decode_s": [stamps[len(out) - 1][0] - stamps[0][0]],
                      "cpu_s": [stamps[len(out) - 1][1] - stamps[0][1]], "steps": 0, "drafts": 0,
                      "accepted": 0}), flush=True)
"""


class LlamaCpp(JsonChild):
    """llama.cpp plain and with its prompt-lookup decoding; `run` has the in-process
    engines' result shape."""

    def __init__(self, python: str, gguf: str, threads: int, k: int) -> None:
        super().__init__(python, LLAMA_CHILD, [gguf, str(threads), str(k)], threads)

    def run(self, name: str, prompt: list[int], max_tokens: int) -> dict:
        return self.ask({"name": name, "prompt": prompt, "tokens": max_tokens})


def baseline(name: str) -> str:
    """The configuration `name` is compared with (its output must equal that one's)."""
    return "llamacpp_off" if name.startswith("llamacpp") else "gguf_off" if name.startswith("gguf") else "off"


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """All `prompts` at once, greedy: each one's tokens and the times of its first and last
    token, and the engine's steps and verification counts over the run."""
    engine = llm.engine
    spec = engine.speculator
    before = (spec.stats.num_drafts, spec.stats.num_accepted_tokens) if spec else (0, 0)
    seqs = [engine.new_sequence(p, SamplingParams(temperature=0, max_tokens=max_tokens)) for p in prompts]
    for seq in seqs:
        engine.add(seq)
    seen = {s.seq_id: 0 for s in seqs}
    first: dict[int, tuple[float, float]] = {}  # (wall, CPU) seconds
    last: dict[int, tuple[float, float]] = {}
    steps = 0
    while engine.has_work():
        engine.step()
        now = (time.perf_counter(), time.thread_time())
        steps += 1
        for seq in seqs:
            n = len(seq.output_token_ids)
            if n != seen[seq.seq_id]:
                first.setdefault(seq.seq_id, now)
                last[seq.seq_id], seen[seq.seq_id] = now, n
    return {"tokens": [s.output_token_ids for s in seqs], "n": [len(s.output_token_ids) for s in seqs],
            "decode_s": [last[s.seq_id][0] - first[s.seq_id][0] for s in seqs],
            "cpu_s": [last[s.seq_id][1] - first[s.seq_id][1] for s in seqs], "steps": steps,
            "drafts": spec.stats.num_drafts - before[0] if spec else 0,
            "accepted": spec.stats.num_accepted_tokens - before[1] if spec else 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams of the batch part (0: none)")
    ap.add_argument("--stream-rounds", type=int, default=9, help="rounds of the concurrent part")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="comma-separated configurations, off first (also self_int4_fixed, ngram_fixed: adaptive off)")
    ap.add_argument("--gguf", action="store_true",
                    help="also pdserve on the default model's GGUF (Q4_1 kept), plain and ngram")
    ap.add_argument("--llama-python", default=None,
                    help="python of a venv with llama-cpp-python: also llama.cpp on the same GGUF, plain and prompt lookup")
    ap.add_argument("--out", default=str(RESULTS / "spec_decode.json"))
    args = ap.parse_args()
    from pdserve.common.loading.default_model import default_gguf, resolve_model_dir
    model = args.model or resolve_model_dir(None)
    chosen = {name: configs(args.k)[name] for name in args.configs.split(",")}
    assert next(iter(chosen)) == "off", "off first: the others are compared with it"
    llms = {name: LLM(model, dtype="float32", quantization="none", num_threads=args.threads, num_kv_blocks=128,
                      max_model_len=1024, **({"speculative_config": spec} if spec else {}))
            for name, spec in chosen.items()}
    gguf = str(default_gguf()) if args.gguf or args.llama_python else None
    if gguf:
        chosen |= {"gguf_off": None, "gguf_ngram": configs(args.k)["ngram"]}
        for name in ("gguf_off", "gguf_ngram"):
            llms[name] = LLM(gguf, quantization="auto", num_threads=args.threads, num_kv_blocks=128, max_model_len=1024,
                             **({"speculative_config": chosen[name]} if chosen[name] else {}))
    llama = LlamaCpp(args.llama_python, gguf, args.threads, args.k) if args.llama_python else None
    single_names = [*llms, *(("llamacpp_off", "llamacpp_lookup") if llama else ())]
    tok = next(iter(llms.values())).tokenizer
    chat = {s: [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in ps]
            for s, ps in {**PROMPTS, "streams": (PROMPTS["chat"] + CHAT_MORE)[:args.streams]}.items()}

    def one(name: str, prompts: list[list[int]]) -> dict:
        return llama.run(name, prompts[0], args.tokens) if name.startswith("llamacpp") else run(llms[name], prompts,
                                                                                              args.tokens)

    for name in single_names:  # warm-up: kernels, packed weights, the policies' first costs
        one(name, chat["chat"][:1])
    single: dict[str, dict[str, list[dict]]] = {s: {name: [] for name in single_names} for s in PROMPTS}
    batch: dict[str, list[dict]] = {name: [] for name in llms}
    mismatches: list[str] = []  # ours: a failure
    peer_mismatches: list[str] = []  # llama.cpp's lookup against its own plain decoding: recorded
    try:
        for rnd in range(args.rounds):
            for s in PROMPTS:
                for i, prompt in enumerate(chat[s]):
                    outs = {name: one(name, [prompt]) for name in single_names}  # taking turns
                    for name, out in outs.items():
                        single[s][name].append(out)
                        if out["tokens"] != outs[baseline(name)]["tokens"]:
                            (peer_mismatches if name.startswith("llamacpp") else mismatches).append(
                                f"{name} {s}[{i}] round {rnd}")
            print(f"round {rnd + 1} of {args.rounds} done (load average {os.getloadavg()[0]:.1f})", flush=True)
        names = list(llms)
        for rnd in range(args.stream_rounds if args.streams else 0):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            outs = {name: run(llms[name], chat["streams"], args.tokens) for name in order}
            for name, out in outs.items():
                batch[name].append(out)
                if out["tokens"] != outs[baseline(name)]["tokens"]:
                    mismatches.append(f"{name} streams round {rnd}")
            print(f"streams round {rnd + 1} of {args.stream_rounds} done (load average {os.getloadavg()[0]:.1f})",
                  flush=True)
    finally:
        if llama:
            llama.close()
    report = {**run_facts(args.threads), "model": str(model), "gguf": gguf, "threads": args.threads,
              "tokens": args.tokens, "k": args.k, "rounds": args.rounds, "stream_rounds": args.stream_rounds,
              "configs": chosen,
              "llamacpp": {"package": "llama-cpp-python", "python": args.llama_python,
                           "lookup": {"max_ngram_size": 4, "num_pred_tokens": args.k},
                           "cpu_ms": "the child process's CPU time, all its threads"} if llama else None,
              "baselines": {name: baseline(name) for name in single_names},
              "single": {}, "streams": {}, "mismatches": mismatches,
              "peer_mismatches": peer_mismatches}
    for s in PROMPTS:
        per = len(chat[s])
        wall = {name: _per_round(outs, per, "decode_s") for name, outs in single[s].items()}
        cpu = {name: _per_round(outs, per, "cpu_s") for name, outs in single[s].items()}
        report["single"][s] = {}
        print(f"\n{s} (single stream, {per} prompts, {args.rounds} rounds): ms/token wall (by round) and CPU;"
              " speed-up against each one's baseline")
        for name in single_names:
            outs, base = single[s][name], baseline(name)
            drafts, accepted = sum(o["drafts"] for o in outs), sum(o["accepted"] for o in outs)
            row = {"wall_ms": wall[name], "cpu_ms": cpu[name], "baseline": base,
                   "speedup_wall": statistics.median(wall[base]) / statistics.median(wall[name]),
                   "speedup_cpu": statistics.median(cpu[base]) / statistics.median(cpu[name]),
                   "acceptance_length": 1 + accepted / drafts if drafts else None,
                   "verify_share": drafts / sum(o["steps"] for o in outs) if drafts else 0.0,
                   "tokens_per_round": sum(sum(o["n"]) for o in outs) // args.rounds}
            report["single"][s][name] = row
            acc = f"{row['acceptance_length']:.2f}" if drafts else "-"
            print(f"  {name:16s} wall {statistics.median(wall[name]):6.1f} x{row['speedup_wall']:4.2f} "
                  f"({' '.join(f'{m:.1f}' for m in wall[name])})  CPU {statistics.median(cpu[name]):6.1f} "
                  f"x{row['speedup_cpu']:4.2f}  acceptance length {acc:>5s}, verifying {row['verify_share']:4.0%} of steps")
    if args.streams:
        print(f"\n{args.streams} concurrent chat streams ({args.stream_rounds} rounds): ms/token per stream, wall and"
              " CPU; paired: the median of the rounds' ratios to off [95% interval]")
        wall = {name: [_per_stream(o, "decode_s") for o in outs] for name, outs in batch.items()}
        cpu = {name: [_per_stream(o, "cpu_s") for o in outs] for name, outs in batch.items()}
        for name, outs in batch.items():
            base = baseline(name)
            drafts, accepted = sum(o["drafts"] for o in outs), sum(o["accepted"] for o in outs)
            row = {"wall_ms": wall[name], "cpu_ms": cpu[name], "baseline": base,
                   "speedup_wall": statistics.median(wall[base]) / statistics.median(wall[name]),
                   "speedup_cpu": statistics.median(cpu[base]) / statistics.median(cpu[name]),
                   "acceptance_length": 1 + accepted / drafts if drafts else None,
                   **paired(wall[base], wall[name], "wall"), **paired(cpu[base], cpu[name], "cpu")}
            report["streams"][name] = row
            print(f"  {name:16s} wall {statistics.median(wall[name]):6.1f} x{row['speedup_wall']:4.2f} "
                  f"paired x{row['paired_wall']:4.2f} [{row['paired_wall_ci95'][0]:.2f}, {row['paired_wall_ci95'][1]:.2f}]"
                  f"  CPU {statistics.median(cpu[name]):6.1f} x{row['speedup_cpu']:4.2f} paired x{row['paired_cpu']:4.2f} "
                  f"[{row['paired_cpu_ci95'][0]:.2f}, {row['paired_cpu_ci95'][1]:.2f}]")
    if peer_mismatches:
        print(f"\nllama.cpp's prompt lookup differs from its plain decoding: {peer_mismatches}")
    if mismatches:
        print(f"\nOUTPUT DIFFERS from the baseline: {mismatches}")
    write_report(report, args.out)
    return 1 if mismatches else 0


def paired(base_ms: list[float], ms: list[float], key: str) -> dict:
    """Each round's speed-up (base's ms over ms in the same round), their median, and a 95%
    percentile-bootstrap interval of that median."""
    ratios = [b / m for b, m in zip(base_ms, ms)]
    lo, hi = bootstrap_percentiles(ratios, [50])[50]
    return {f"paired_{key}_ratios": ratios, f"paired_{key}": statistics.median(ratios), f"paired_{key}_ci95": [lo, hi]}


def _per_stream(out: dict, key: str) -> float:
    """ms per token of a concurrent run: the streams' mean of (last - first token) / (tokens - 1)."""
    return 1000 * statistics.mean(d / (n - 1) for d, n in zip(out[key], out["n"]) if n > 1)


def _per_round(outs: list[dict], per: int, key: str) -> list[float]:
    """ms per token of each round: its prompts' decode time (`key`: wall or CPU) over their
    tokens after the first."""
    rounds = [outs[i:i + per] for i in range(0, len(outs), per)]
    return [1000 * sum(sum(o[key]) for o in r) / sum(sum(n - 1 for n in o["n"]) for o in r) for r in rounds]


if __name__ == "__main__":
    sys.exit(main())
