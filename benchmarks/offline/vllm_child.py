"""vLLM's offline `LLM.generate` on a workload written by benchmarks/offline/vs_vllm.py; run with
the vLLM venv's python (it imports nothing from pdserve):

    VLLM_TARGET_DEVICE=cpu /work/vllm-venv/bin/python -m benchmarks.offline.vllm_child WORKLOAD.json OUT.json

WORKLOAD.json: {"model", "prompts" (token id lists), "output_lens", "max_model_len",
"max_num_seqs", "max_num_batched_tokens", and optionally "dtype" (default float32)}. Greedy with ignore_eos, so every prompt yields
exactly its output length; a 2-prompt warm-up runs first and is not counted. OUT.json gets
output_tokens, seconds (wall time of the one timed `generate`), cpu_seconds (this process,
not vLLM's engine-core child) and tokens_per_s. The `__main__` guard matters: vLLM starts
its engine core in a spawned process that imports this file again.
"""
from __future__ import annotations

import json
import sys
import time


def main(workload_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    w = json.loads(open(workload_path).read())
    llm = LLM(model=w["model"], dtype=w.get("dtype", "float32"), max_model_len=w["max_model_len"], max_num_seqs=w["max_num_seqs"],
              max_num_batched_tokens=w["max_num_batched_tokens"], seed=0)
    prompts = [{"prompt_token_ids": p} for p in w["prompts"]]
    warm = [{"prompt_token_ids": p["prompt_token_ids"][:64]} for p in prompts[:2]]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w["output_lens"]]
    cpu0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != w["output_lens"]:
        raise RuntimeError("vLLM did not produce exactly max_tokens per prompt (ignore_eos)")
    res = {"output_tokens": sum(got), "seconds": seconds, "cpu_seconds": cpu, "tokens_per_s": sum(got) / seconds}
    open(out_path, "w").write(json.dumps(res))
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
