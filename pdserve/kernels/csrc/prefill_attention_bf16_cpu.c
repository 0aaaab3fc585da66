/* Prefill attention over a bf16 KV cache: prefill_attention_cpu.c compiled again with its
 * keys and values widened to float32 (exact) as they are packed, as
 * pd_prefill_attention_bf16 (the same arguments, the caches' elements 16-bit). */
#define PD_KV_BF16 1
#include "prefill_attention_cpu.c"
