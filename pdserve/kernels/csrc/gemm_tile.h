/* The register tiles of kernels/csrc/gemm_tile_cpu.c, for the packed GEMM (gemm_cpu.c) and
 * the other kernels of the library that run small products on them (prefill attention). */
#ifndef PD_GEMM_TILE_H
#define PD_GEMM_TILE_H
#include <stdint.h>

#define PD_NR 16 /* columns per panel of a packed operand */
#define PD_QGROUP 32 /* k values per scale of a quantized panel (gemm_quant_cpu.c) */

/* What a packed weight's panels hold (kernels.cpu_native.WEIGHT_KINDS) */
#define PD_W_F32 0
#define PD_W_BF16 1  /* widened to float32 in registers */
#define PD_W_Q8 2    /* int8, a float16 scale per 32 along k (GGUF Q8_0) */
#define PD_W_Q4 3    /* int4 with offset 8, a float16 scale per 32 (GGUF Q4_0) */
#define PD_W_Q4M 4   /* int4, a float16 scale and minimum per 32 (GGUF Q4_1) */

/* Whether qdot_cpu.c's VNNI copies are built (its header): AVX2 code, and a gcc that knows
   the targets (11 or later: avxvnni) */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__GNUC__) && !defined(__clang__) \
    && __GNUC__ >= 11
#define PD_QVNNI 1
#endif
#if defined(__AVX512F__)
#define PD_MR 8 /* rows per tile: by two panels, 16 accumulators of 16 lanes */
#else
#define PD_MR 6 /* rows per tile: by one panel, 12 accumulators of 8 lanes */
#endif
/* Which kinds' two-panel tiles (pd_gemm_tile2*) are one tile in this build, not two
 * one-panel tiles: every kind's on AVX-512, bf16's on AVX2 (for the few rows of a
 * decode step). gemm_cpu.c's run_panels takes panels of those kinds two at a time. */
#if defined(__AVX512F__)
#define PD_PANEL_PAIRS 1
#elif defined(__AVX2__) && defined(__FMA__)
#define PD_BF16_PAIRS 1
#endif

/* y[0:rows, 0:ncols] (+)= x[0:rows, 0:kc] @ p[0:kc, 0:ncols], rows <= PD_MR, ncols <= PD_NR.
 * x's element (i, kk) at x[i * rs + kk * ks]; p is one packed panel, [kc][PD_NR];
 * accumulate: y += the sum, else y = the sum (+ bias[0:ncols] when bias is not NULL).
 * Each output is one chain of fused multiply-adds over kk from zero. */
void pd_gemm_tile(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const float *p, float *y, int64_t ldy,
                  int accumulate, const float *bias, int ncols);

/* The same over two panels at once, p0 then p1 (columns 0..15 and 16..16 + ncols1 - 1 of
 * y; bias, when given, covers both): one tile on AVX-512, pair tiles up to 5 rows on AVX2,
 * two one-panel tiles otherwise. */
void pd_gemm_tile2(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const float *p0, const float *p1,
                   float *y, int64_t ldy, int accumulate, const float *bias, int ncols1);

/* pd_gemm_tile and pd_gemm_tile2 on bf16 panels, widened to float32 in registers (exact):
 * the float32 tiles' bits on the widened weight. */
void pd_gemm_tile_bf16(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const uint16_t *p, float *y,
                       int64_t ldy, int accumulate, const float *bias, int ncols);
void pd_gemm_tile2_bf16(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const uint16_t *p0,
                        const uint16_t *p1, float *y, int64_t ldy, int accumulate, const float *bias, int ncols1);
#if defined(PD_BF16_PAIRS)
/* pd_gemm_tile2(_bf16) with each panel's columns where they lie: p0's to y0 (bias0,
 * ncols0), p1's to y1 (bias1, ncols1), so that decode rows can pair panels from two
 * streams (AVX2 builds): pair tiles up to 5 float32 rows (3, then the rest) and 2 bf16
 * rows, two one-panel tiles past that */
void pd_gemm_tile2_apart(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const float *p0,
                         const float *p1, float *y0, float *y1, int64_t ldy, int accumulate, const float *bias0,
                         const float *bias1, int ncols0, int ncols1);
void pd_gemm_tile2_apart_bf16(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const uint16_t *p0,
                              const uint16_t *p1, float *y0, float *y1, int64_t ldy, int accumulate,
                              const float *bias0, const float *bias1, int ncols0, int ncols1);
#endif

/* Weights k0 .. k0 + kc - 1 of one panel of a quantized weight (gemm_quant_cpu.c), `panel`
 * its first block, as float32 [kc][PD_NR] at out: the panel the float32 tiles read. */
void pd_dequant_slice(int kind, const uint8_t *panel, int64_t k0, int64_t kc, float *out);
/* Bytes of one block (one group of one panel) of a quantized kind; 0 for another kind. */
int64_t pd_quant_block_bytes(int kind);

/* Rows of x up to which pd_gemm_q multiplies a quantized weight by int8 dot products
 * (pd_gemm_qdot: decode batches), more by the float32 tile on dequantized slices (prefill
 * chunks: the float32 product on the dequantized weight, bit for bit); -DPD_QDOT_ROWS=...
 * moves it */
#ifndef PD_QDOT_ROWS
#define PD_QDOT_ROWS 8
#endif
/* A quantized weight's product by int8 dot products (gemm_quant_cpu.c): pd_gemm_q's and
 * pd_gemm_silu_q's arguments and results. */
int pd_gemm_qdot(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, const float *bias,
                 float *y, int64_t ldy, int64_t n, int num_threads);
int pd_gemm_silu_qdot(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, float *act,
                      int64_t lda, int64_t inter, int num_threads);

#endif
