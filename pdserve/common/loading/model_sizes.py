"""The model shapes `pdserve make-model` writes (`--size`): the test and benchmark models
and published families' exact shapes. Apart from model_factory.py, which draws and writes
the weights, so that the command line can list the sizes without importing torch."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSize:
    """One model shape and what config.json says beside it. A published family's shape
    (`arch` set) fixes the architecture, the vocabulary and the RoPE settings."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # BPE training target; the trained vocabulary may come out smaller
    max_positions: int
    arch: str | None = None  # the family's architecture; None: any (--arch)
    model_vocab: int | None = None  # config.json's vocab_size (the family's); None: the tokenizer's
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie: bool | None = None  # None: tied for qwen3 (the test models' rule)
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"  # on disk: float32 or bfloat16

    def scaled(self, **changes) -> "ModelSize":
        """The same family with some dimensions changed (a test's scaled-down copy)."""
        return dataclasses.replace(self, **changes)

    def num_parameters(self) -> int:
        """Parameters of the model config.json describes (an untied lm_head counted)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        vocab = self.model_vocab or self.vocab
        per_layer = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate + 2 * self.hidden
        if self.arch == "qwen3":
            per_layer += 2 * self.head_dim  # q_norm, k_norm
        if self.arch == "qwen2":
            per_layer += q + 2 * kv  # q/k/v biases
        tied = self.tie if self.tie is not None else False
        return vocab * self.hidden * (1 if tied else 2) + self.layers * per_layer + self.hidden


# The published families' shapes, written from their config.json files on the Hugging Face
# Hub as published (meta-llama/Llama-3.1-8B, Qwen/Qwen3-8B, Qwen/Qwen3-1.7B), from
# knowledge of those files, not fetched: hidden, intermediate, layers, heads, KV heads,
# head_dim, vocab_size, max_position_embeddings, rms_norm_eps, rope_theta, rope_scaling,
# tie_word_embeddings and torch_dtype are theirs. `llama3-8b` is Llama 3.1's 8B (Llama 3's
# 8B had no rope_scaling and 8192 positions). What is not theirs: the tokenizer (ours,
# trained offline, smaller than the model's vocabulary: ids past it are never produced by
# encoding and decode to nothing) and so the bos/eos/pad ids, which are our tokenizer's.
LLAMA3_ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}
FAMILY_TOKENIZER_VOCAB = 8192  # the BPE target of the published families' tokenizer

SIZES = {
    # a test model: ~1M parameters, fast enough for token-exact tests on 2 cores
    "tiny": ModelSize(hidden=128, intermediate=384, layers=4, heads=4, kv_heads=2, head_dim=32,
                      vocab=2048, max_positions=2048),
    # a benchmark model: ~40M parameters, Qwen3-0.6B-like ratios with fewer layers
    "small": ModelSize(hidden=512, intermediate=1536, layers=12, heads=8, kv_heads=4, head_dim=64,
                       vocab=8192, max_positions=4096),
    # Llama-3.1-8B: 8.03B parameters
    "llama3-8b": ModelSize(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
                           vocab=FAMILY_TOKENIZER_VOCAB, max_positions=131072, arch="llama", model_vocab=128256,
                           rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_SCALING, tie=False, rms_norm_eps=1e-5,
                           dtype="bfloat16"),
    # Qwen3-8B: 8.19B parameters
    "qwen3-8b": ModelSize(hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8, head_dim=128,
                          vocab=FAMILY_TOKENIZER_VOCAB, max_positions=40960, arch="qwen3", model_vocab=151936,
                          rope_theta=1000000.0, tie=False, rms_norm_eps=1e-6, dtype="bfloat16"),
    # Qwen3-1.7B: 1.72B parameters (the lm_head tied to the embedding)
    "qwen3-1.7b": ModelSize(hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8, head_dim=128,
                            vocab=FAMILY_TOKENIZER_VOCAB, max_positions=40960, arch="qwen3", model_vocab=151936,
                            rope_theta=1000000.0, tie=True, rms_norm_eps=1e-6, dtype="bfloat16"),
}
