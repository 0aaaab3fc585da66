"""Decoder-only model code (Qwen3, Qwen2, Llama) on the paged KV cache."""
from pdserve.common.models.decoder import DecoderForCausalLM

__all__ = ["DecoderForCausalLM"]
