"""Put on vLLM's PYTHONPATH by `--emulate-avx2` (benchmarks/harness/servers.py): every process of
vLLM, spawned ones included, starts with torch reporting no AVX-512, so vLLM loads its
AVX2 kernels (`vllm._C_AVX2`) as it would on an AVX2-only CPU. Does nothing unless
PDSERVE_EMULATE_AVX2=1."""
import os
import sys

if os.environ.get("PDSERVE_EMULATE_AVX2") == "1":
    import torch.cpu

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    print(f"[emulate-avx2] pid {os.getpid()}: AVX-512 hidden from torch.cpu", file=sys.stderr)
