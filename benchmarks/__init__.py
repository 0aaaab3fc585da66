"""pdserve's benchmarks, each run as `python -m benchmarks.<group>.<name>` from the repository
root (never as tests; nothing here imports tests):

- harness/      what they share: servers (pdserve, vLLM's CPU build), models, traces, run
                facts, timing, the memory-bandwidth bound, JSON and plot writing, the
                index of committed results (docs/results/index.json)
- compare       every system on one trace, interleaved, with derived SLO regimes
                (`python -m benchmarks.compare`; README's comparison table comes from it)
- offline/      the offline engine: throughput against transformers and vLLM, phases,
                prefill FLOP/s, sampling features, structured output
- decode/       single-stream decode against the streaming bound, its parts, llama.cpp,
                speculative decoding
- cpu_kernels/  the native CPU GEMMs against MKL / oneDNN (bf16 and int8 too), and A/B
                against another checkout
- serving/      the serving path: chat output shaping, /health under load, join time, recovery
- slo/          latency-SLO experiments: the planner on held-out traffic, conditional
                disaggregation, the simulator against served runs
- kv_transfer/  KV transfer bandwidth, handoff latency, cost by path
- routing/      router overhead and routing quality
- gpu/          an 8B-class model on one GPU beside its limits (`python -m benchmarks.gpu.at_size`)
- gpu_check*.py the GPU checks (`python benchmarks/gpu_check.py` on a GPU machine, docs/gpu.md)

Committed results live under docs/results/<group>/, indexed in docs/results/index.json.
"""
