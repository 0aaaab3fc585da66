"""A Q4_K_M (or Q4_0) SmolLM2, kept quantized, against its own float32 conversion: the
kinds its linears run in, their bytes, perplexity and greedy top-5 agreement.

    python -m benchmarks.decode.gguf_kquant [--scheme q4_k_m|q4_0] [--threads 1] [--out results/gguf_kquant.json]
    python -m benchmarks.decode.single_stream --model results/gguf_kquant/smollm2-q4_k_m.gguf \\
        --dtype float32+gguf,float32 --threads 1            # its decode speed beside float32's
    python -m benchmarks.decode.vs_llamacpp --llama-python /work/llama-venv/bin/python \\
        --gguf results/gguf_kquant/smollm2-q4_k_m.gguf      # beside llama.cpp on the same file

The file is written here from the embedded model's float32 conversion with llama.cpp's
Q4_K_M tensor types for this model (llama.cpp's `llama_tensor_get_type`): Q4_K, with Q6_K
for attn_v and ffn_down in the layers `use_more_bits` picks (the first and last eighth,
every third between) and for the tied embedding / output; where a row's length is not a
multiple of 256 (SmolLM2's hidden size 576: every matrix but ffn_down) llama.cpp's
fallbacks, Q5_0 for Q4_K and Q8_0 for Q6_K. The blocks come from benchmarks/harness/gguf_writer.py
(llama.cpp's layout; K-quant scales by plain rounding, not llama.cpp's search, so the
file's quality is a little below a real llama-quantize file's). Both engines load the same
file's conversion: `--quantization gguf` (common/loading/gguf_quant.py: Q4_K as int4, the
rest int8) and `--quantization none` (its float32 values). `--scheme q4_0` writes llama.cpp's
Q4_0 instead: every linear Q4_0, the tied embedding / output Q8_0 (Q6_K's fallback), the
type llama.cpp repacks for AVX2.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.harness.paths import REPO

from benchmarks.harness.facts import run_facts
from benchmarks.harness.output import write_report
from pdserve.common import LLM
from pdserve.common.engine.scoring import divergence, perplexity, sequence_logits
from pdserve.common.loading.default_model import resolve_model_dir
from pdserve.common.loading.gguf_convert import convert_gguf
from pdserve.common.quantization import kept_linears
from benchmarks.harness.gguf_writer import QK_K, write_gguf
from pdserve.common.sampling_params import SamplingParams

PROMPTS = ("The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are", "Water boils at", "My favourite book is")
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # llama.cpp's, for a row length not a multiple of 256

# The fixed text perplexity is scored on, here and by the precision tests (tests/support/engines.py
# imports it: benchmarks import nothing from tests).
TEXT = ("pdserve is a prefill/decode disaggregated LLM serving system in Python. Prefill workers, batched and "
        "compute-bound, and decode workers, continuously batched and bound by memory bandwidth, run as separate "
        "processes, each on its own device, each with its own paged KV block manager. A finished prefill's KV "
        "blocks move to a decode worker through the transfer layer. A router sends each request to a prefill "
        "worker by prefix overlap and load, and to a decode worker by load. Clients submit over ZeroMQ or HTTP. "
        "Its users launch prefill and decode processes on separate GPUs, submit traffic, and run latency "
        "experiments comparing configurations, including the same workers run colocated as a baseline. The "
        "correctness oracle is transformers' own generate, token for token, in float32 on the CPU; below float32 "
        "the standard is vLLM's: where the two greedy streams first differ, each token is in the other's top five.")


def greedy(llm, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `prompt` (ignore_eos)."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_types(layers: int, hidden: int, intermediate: int) -> dict[str, str]:
    """GGUF tensor name (without ".weight") -> type, for a tied llama of this shape."""
    def fit(qtype: str, row: int) -> str:
        return qtype if row % QK_K == 0 else FALLBACK[qtype]
    types = {"token_embd": fit("Q6_K", hidden)}  # tied: the embedding is the output layer
    for i in range(layers):
        more = use_more_bits(i, layers)
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            types[f"blk.{i}.{name}"] = fit("Q4_K", hidden)
        types[f"blk.{i}.attn_v"] = fit("Q6_K" if more else "Q4_K", hidden)
        types[f"blk.{i}.ffn_down"] = fit("Q6_K" if more else "Q4_K", intermediate)
    return types


def q4_0_types(hidden: int) -> dict[str, str]:
    """llama.cpp's Q4_0 file of a tied llama: Q4_0 but the embedding / output (Q6_K, or its
    fallback Q8_0)."""
    return {"token_embd": "Q6_K" if hidden % QK_K == 0 else FALLBACK["Q6_K"]}


SCHEMES = {"q4_k_m": ("Q4_K", lambda cfg: q4_k_m_types(cfg["num_hidden_layers"], cfg["hidden_size"],
                                                       cfg["intermediate_size"])),
           "q4_0": ("Q4_0", lambda cfg: q4_0_types(cfg["hidden_size"]))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheme", choices=sorted(SCHEMES), default="q4_k_m", help="llama.cpp file type to write")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--out", default=str(REPO / "results" / "gguf_kquant.json"))
    args = ap.parse_args()
    src = Path(resolve_model_dir(None))
    cfg = json.loads((src / "config.json").read_text())
    if not cfg.get("tie_word_embeddings"):
        raise SystemExit("gguf_kquant: the Q4_K_M rules here are a tied llama's")
    qtype, rules = SCHEMES[args.scheme]
    types = rules(cfg)
    work = REPO / "results" / "gguf_kquant"
    work.mkdir(parents=True, exist_ok=True)
    path = write_gguf(src, work / f"smollm2-{args.scheme}.gguf", qtype, types)
    folder = work / f"smollm2-{args.scheme}"
    shutil.rmtree(folder, ignore_errors=True)  # an earlier run's conversion of the file just rewritten
    folder = convert_gguf(path, folder, quiet=True)
    matrices = 1 + 7 * cfg["num_hidden_layers"]  # the embedding, and per layer q, k, v, o, gate, up, down
    file_types = collections.Counter({qtype: matrices - len(types)}) + collections.Counter(types.values())
    print(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB): tensor types {dict(file_types)}")

    llms = {q: LLM(str(folder), dtype="float32", num_threads=args.threads, num_kv_blocks=64, max_model_len=512,
                   quantization=q, enable_prefix_caching=False, max_num_batched_tokens=512) for q in ("none", "gguf")}
    by_kind = kept_linears(llms["gguf"].engine.runner.model)
    kept = {kind: len(ws) for kind, ws in by_kind.items()}
    kept_bytes = sum(w.nbytes for ws in by_kind.values() for w in ws)
    print(f"kept linears by kind {dict(kept)}: {kept_bytes / 1e6:.1f} MB")
    f32, tok = llms["none"], llms["none"].tokenizer
    ids = tok.encode(TEXT)[:200]
    ppl = {q: perplexity(sequence_logits(llm.engine, ids), ids) for q, llm in llms.items()}
    prompts = []
    for text in PROMPTS:
        prompt = tok.encode(text)
        ref, ours = greedy(f32, prompt, args.tokens), greedy(llms["gguf"], prompt, args.tokens)
        d = divergence(prompt, ref, ours, f32.engine, llms["gguf"].engine)
        prompts.append({"prompt": text, "first_divergence": d.position, "within_top5": d.within_top(5),
                        "ranks": [d.a_rank_in_b, d.b_rank_in_a]})
    identical = sum(p["first_divergence"] is None for p in prompts)
    print(f"perplexity of the fixed text: float32 {ppl['none']:.3f}, kept {ppl['gguf']:.3f} "
          f"({ppl['gguf'] / ppl['none'] - 1:+.2%})")
    print(f"greedy {args.tokens} tokens: {identical} of {len(prompts)} prompts identical; first divergences "
          f"{[p['first_divergence'] for p in prompts]}; all within the top 5: {all(p['within_top5'] for p in prompts)}")
    write_report({**run_facts(), "scheme": args.scheme, "file": str(path), "file_types": dict(file_types), "kept_kinds": kept,
                  "kept_linear_bytes": kept_bytes, "perplexity": ppl, "prompts": prompts,
                  "identical": identical, "threads": args.threads}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
