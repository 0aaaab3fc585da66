/* Weight-only int8 / int4 products on packed quantized panels: int8 and int4 weights with a
 * float16 scale (and, for asymmetric int4, a float16 minimum) per group of 32 values along
 * k. Two ways to multiply them:
 *   pd_gemm_qdot    pd_gemm_q's way up to PD_QDOT_ROWS rows of x (decode batches): each
 *                   row of x quantized per 32 values to int8 with one float scale
 *                   (llama.cpp's q8_0 / q8_1 activations), integer dot products per
 *                   group, a few float steps per group and column (qdot_cpu.c, whose
 *                   header gives its arithmetic).
 *   pd_dequant_slice  pd_gemm_q's way past that (prefill chunks; pd_gemm_q_dequant at any
 *                   m): gemm_cpu.c dequantizes one panel's slice of k (at most 192 x 16
 *                   weights, 12 KB, in L1) to float32 here, once per block of up to 96 rows
 *                   of x, and runs the float32 register tile on it: the product is pd_gemm's
 *                   on the dequantized weight bit for bit, at the float32 tile's speed.
 * On a 2-core AMD EPYC Zen 1 (AVX2) pd_gemm_qdot took 0.4-0.8x the tile's time at 1 to 256
 * rows (benchmarks/cpu_linear_quant.py); prefill keeps the float32 tile so that prompt
 * logits (and the first token) are exactly float32's on the dequantized weights.
 *
 * Packed layout (kernels.quant.pack): panel j holds output columns 16 j .. 16 j + 15 (zero
 * past n, as the float panels), as k / 32 blocks of one group each, block g:
 *     scales  16 x fp16        the columns' scales d
 *     mins    16 x fp16        (PD_W_Q4M only) the columns' minimums m
 *     data    8 quads t, rows k = 32 g + 4 t .. 32 g + 4 t + 3, each two halves h
 *             (columns 8 h .. 8 h + 7) of 8 columns c of 4 rows j:
 *             PD_W_Q8:  64 bytes, byte 32 h + 4 c + j: int8 q               w = d * q
 *             PD_W_Q4:  32 bytes, byte 4 c + j: half 0 in the low nibble,
 *                       half 1 in the high; q in 0..15                      w = d * (q - 8)
 *             PD_W_Q4M: as PD_W_Q4                                          w = d * q + m
 * so one 32-byte load holds, in each 32-bit lane, four consecutive k of one column: the
 * operand of _mm256_maddubs_epi16 + _mm256_madd_epi16 against four activation bytes
 * broadcast. These are GGUF's Q8_0, Q4_0 and Q4_1 (kernels.quant repacks their blocks)
 * and what `--quantization int8|int4` writes from float weights (int4: Q4_1's form).
 *
 * The weights are computed in float32 exactly as gguf-py dequantizes (one rounding for the
 * product, one more for + m). Empty asm statements pin each dequantized vector, so that
 * -ffast-math cannot fuse d * q + m into one fused multiply-add. Slices are whole quads
 * (k0 and kc multiples of 4).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PD_QAVX2 1
#endif

#include "quant_block.h"

#define NR PD_NR
#define QG PD_QGROUP
#define AI inline __attribute__((always_inline))

int64_t pd_quant_block_bytes(int kind) { return pd_quant_block_size(kind); }

#ifdef PD_QAVX2
#define PIN(v) __asm__("" : "+x"(v))
/* Row J of a quad's half (one column's 4 rows in each 32-bit lane) as int32 codes; for
 * the int4 kinds v is the half's nibbles already shifted to the low nibble of each byte */
#define ROW_CODES(KIND, v, J)                                                                                          \
    ((KIND) == PD_W_Q8 ? _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * (J)), 24)                                     \
                       : _mm256_and_si256(_mm256_srli_epi32(v, 8 * (J)), _mm256_set1_epi32(0x0f)))

/* The weights of one row from its codes: d q (+ m), each step rounded as gguf-py rounds
 * it, pinned against contraction */
static AI void weights(int kind, __m256i c0, __m256i c1, __m256 d0, __m256 d1, __m256 m0, __m256 m1, __m256 *b0,
                       __m256 *b1) {
    if (kind == PD_W_Q4) {
        c0 = _mm256_sub_epi32(c0, _mm256_set1_epi32(8));
        c1 = _mm256_sub_epi32(c1, _mm256_set1_epi32(8));
    }
    __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(c0), d0);
    __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(c1), d1);
    PIN(w0);
    PIN(w1);
    if (kind == PD_W_Q4M) {
        w0 = _mm256_add_ps(w0, m0);
        w1 = _mm256_add_ps(w1, m1);
        PIN(w0);
        PIN(w1);
    }
    *b0 = w0;
    *b1 = w1;
}

/* One quad's row J (constant) of both halves: 16 weights at out */
#define QROW(KIND, J)                                                                                                  \
    {                                                                                                                  \
        __m256 b0, b1;                                                                                                 \
        weights(KIND, ROW_CODES(KIND, v0, J), ROW_CODES(KIND, v1, J), d0, d1, m0, m1, &b0, &b1);                      \
        _mm256_storeu_ps(out + (kk + (J)) * NR, b0);                                                                   \
        _mm256_storeu_ps(out + (kk + (J)) * NR + 8, b1);                                                               \
    }

/* pd_dequant_slice for one kind (a constant in each call below) */
static AI void dequant_slice(const int kind, const uint8_t *panel, int64_t k0, int64_t kc, float *out) {
    const int64_t bb = pd_quant_block_bytes(kind), hdr = pd_quant_header_bytes(kind), qb = pd_quant_quad_bytes(kind);
    for (int64_t kk = 0; kk < kc;) {
        const int64_t kg = k0 + kk, end = kk + QG - kg % QG < kc ? kk + QG - kg % QG : kc;
        const uint8_t *blk = panel + kg / QG * bb, *q = blk + hdr + kg % QG / 4 * qb;
        __m256 d0, d1, m0, m1;
        pd_block_scales(blk, kind, &d0, &d1, &m0, &m1);
        for (; kk < end; kk += 4, q += qb) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)q);
            const __m256i v1 = kind == PD_W_Q8 ? _mm256_loadu_si256((const __m256i *)(q + 32)) : _mm256_srli_epi32(v0, 4);
            QROW(kind, 0) QROW(kind, 1) QROW(kind, 2) QROW(kind, 3)
        }
    }
}

void pd_dequant_slice(int kind, const uint8_t *panel, int64_t k0, int64_t kc, float *out) {
    switch (kind) {
        case PD_W_Q8: dequant_slice(PD_W_Q8, panel, k0, kc, out); break;
        case PD_W_Q4: dequant_slice(PD_W_Q4, panel, k0, kc, out); break;
        case PD_W_Q4M: dequant_slice(PD_W_Q4M, panel, k0, kc, out); break;
        default: break;
    }
}
#else
/* Without AVX2 + F16C (a build on another CPU): the same values in plain C. */
static float weight(int kind, const uint8_t *blk, int64_t r, int c) {
    const float d = pd_f16(blk + 2 * c);
    const uint8_t *qd = blk + pd_quant_header_bytes(kind) + r / 4 * pd_quant_quad_bytes(kind);
    if (kind == PD_W_Q8) return d * (float)(int8_t)qd[32 * (c / 8) + 4 * (c % 8) + r % 4];
    const uint8_t b = qd[4 * (c % 8) + r % 4];
    const int q = c < 8 ? b & 15 : b >> 4;
    return kind == PD_W_Q4 ? d * (float)(q - 8) : d * (float)q + pd_f16(blk + 2 * NR + 2 * c);
}

void pd_dequant_slice(int kind, const uint8_t *panel, int64_t k0, int64_t kc, float *out) {
    const int64_t bb = pd_quant_block_bytes(kind);
    for (int64_t kk = 0; kk < kc; kk++) {
        const int64_t kg = k0 + kk;
        for (int c = 0; c < NR; c++) out[kk * NR + c] = weight(kind, panel + kg / QG * bb, kg % QG, c);
    }
}
#endif
