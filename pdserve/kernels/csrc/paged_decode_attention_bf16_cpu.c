/* Paged decode attention over a bf16 KV cache: paged_decode_attention_cpu.c compiled again
 * with its K and V loads widening bf16 to float32 in registers (exact), as
 * pd_paged_decode_attention_bf16 (the same arguments, the caches' elements 16-bit). Half
 * the bytes of a float32 cache are read; q, the scores and the output stay float32. */
#define PD_KV_BF16 1
#include "paged_decode_attention_cpu.c"
