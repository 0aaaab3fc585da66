"""benchmarks/decode/gguf_kquant.py's llama.cpp tensor types, without writing a file: Q4_K_M's
wider layers and the fallbacks for rows that are not a multiple of 256."""
from __future__ import annotations

from tests.support.bench_scripts import script


def test_q4_k_m_types_follow_llama_cpps_rules_and_fallbacks():
    g = script("decode.gguf_kquant")
    more = [i for i in range(30) if g.use_more_bits(i, 30)]
    # the first and last eighth (30 // 8 = 3; from 7 * 30 // 8 = 26), every third between
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    smol = g.q4_k_m_types(30, 576, 1536)  # SmolLM2: hidden 576 is not a multiple of 256
    assert smol["token_embd"] == "Q8_0"  # the tied output's Q6_K, fallen back
    assert {smol[f"blk.{i}.attn_q"] for i in range(30)} == {"Q5_0"}
    assert [i for i in range(30) if smol[f"blk.{i}.ffn_down"] == "Q6_K"] == more  # rows of 1536 keep K-quants
    assert {smol[f"blk.{i}.ffn_down"] for i in range(30) if i not in more} == {"Q4_K"}
    assert [i for i in range(30) if smol[f"blk.{i}.attn_v"] == "Q8_0"] == more
    wide = g.q4_k_m_types(8, 1024, 2816)  # every row a multiple of 256: no fallbacks
    assert wide["token_embd"] == "Q6_K" and wide["blk.0.attn_q"] == "Q4_K" and wide["blk.0.attn_v"] == "Q6_K"
    assert wide["blk.2.attn_v"] == "Q4_K" and wide["blk.3.attn_v"] == "Q6_K" and g.q4_0_types(576) == {"token_embd": "Q8_0"}
