"""GGUF files for tests, written by benchmarks/harness/gguf_writer.py (benchmarks/decode/
gguf_kquant.py writes its K-quant files with the same writer; benchmarks import nothing from
tests, so the writer lives there and tests reach it through bench_scripts)."""
from __future__ import annotations

from tests.support.bench_scripts import script

_writer = script("harness.gguf_writer")
QUANT_TYPES, K_QUANT_TYPES, QK_K = _writer.QUANT_TYPES, _writer.K_QUANT_TYPES, _writer.QK_K
write_gguf, quantize_k = _writer.write_gguf, _writer.quantize_k
pack_q4_k, pack_q5_k, pack_q6_k = _writer.pack_q4_k, _writer.pack_q5_k, _writer.pack_q6_k
