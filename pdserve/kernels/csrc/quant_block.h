/* The block layout of a quantized panel (drawn in gemm_quant_cpu.c's header), shared by the
 * dequantized slices (gemm_quant_cpu.c) and the int8 dot products (qdot_cpu.c). */
#ifndef PD_QUANT_BLOCK_H
#define PD_QUANT_BLOCK_H
#include <stdint.h>
#include <string.h>

#include "gemm_tile.h"

#define PD_QUADS (PD_QGROUP / 4) /* quads of 4 rows per group */

/* Bytes of one block (one group of one panel) of a quantized kind; 0 for another kind */
static inline int64_t pd_quant_block_size(int kind) {
    switch (kind) {
        case PD_W_Q8: return 2 * PD_NR + PD_QGROUP * PD_NR;
        case PD_W_Q4: return 2 * PD_NR + PD_QGROUP * PD_NR / 2;
        case PD_W_Q4M: return 4 * PD_NR + PD_QGROUP * PD_NR / 2;
        default: return 0;
    }
}

/* Bytes of a block's scales (and, for PD_W_Q4M, minimums) before its codes */
static inline int64_t pd_quant_header_bytes(int kind) { return kind == PD_W_Q4M ? 4 * PD_NR : 2 * PD_NR; }

/* Bytes of one quad (4 rows of the panel's 16 columns) of codes */
static inline int64_t pd_quant_quad_bytes(int kind) { return kind == PD_W_Q8 ? 4 * PD_NR : 2 * PD_NR; }

/* An IEEE float16 at p as float32 (the plain C builds' reading of the scales) */
static inline float pd_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    float f;
    if (e == 0) {
        f = (float)m * (1.0f / 16777216.0f); /* subnormal: m 2^-24 */
        return s ? -f : f;
    }
    const uint32_t u = s | (e == 31 ? 0x7f800000u | m << 13 : (e + 112) << 23 | m << 13);
    memcpy(&f, &u, sizeof f);
    return f;
}

#ifdef PD_QAVX2
/* A block's 16 scales (d0: columns 0-7, d1: 8-15) as float32, and for PD_W_Q4M its 16
   minimums (m0, m1; the scales again for the other kinds, which have none) */
static inline __attribute__((always_inline)) void pd_block_scales(const uint8_t *blk, int kind, __m256 *d0,
                                                                  __m256 *d1, __m256 *m0, __m256 *m1) {
    *d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    *d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
    *m0 = *d0;
    *m1 = *d1;
    if (kind == PD_W_Q4M) {
        *m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32)));
        *m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 48)));
    }
}
#endif

#endif
