/* bf16 on the CPU kernels: a bf16 value is the high half of a float32's bits, so widening
 * is exact (shift left 16); narrowing rounds to nearest even (pd_f32_to_bf16_row in
 * elementwise_cpu.c). And the KV cache's element type `kv_t` of the attention sources,
 * which are compiled twice: float32, and with PD_KV_BF16 for a bf16 cache
 * (*_bf16_cpu.c), every K and V value read through kv_f32. */
#ifndef PD_BF16_H
#define PD_BF16_H
#include <stdint.h>
#include <string.h>

static inline float pd_bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#ifdef PD_KV_BF16
typedef uint16_t kv_t;
#define kv_f32(x) pd_bf16_to_f32(x)
#else
typedef float kv_t;
#define kv_f32(x) (x)
#endif

#endif
