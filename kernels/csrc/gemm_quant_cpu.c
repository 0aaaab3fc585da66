/* Weight-only int8 / int4 products on packed quantized panels: int8 and int4 weights with a
 * float16 scale (and, for asymmetric int4, a float16 minimum) per group of 32 values along
 * k. Two ways to multiply them:
 *   pd_gemm_qdot    pd_gemm_q's way up to PD_QDOT_ROWS rows of x (decode batches): each
 *                   row of x quantized per 32 values to int8 with one float scale
 *                   (llama.cpp's q8_0 / q8_1 activations), integer dot products per
 *                   group, one float multiply-add per group and column.
 *   pd_gemm_tile_q  pd_gemm_q's way past that (prefill chunks; pd_gemm_q_dequant at any m):
 *                   the GEMM's register tile (kernels/csrc/gemm_cpu.c) with the weights
 *                   dequantized to float32 in registers, the product pd_gemm's on the
 *                   dequantized weight bit for bit.
 * On a 2-core AMD EPYC Zen 1 (AVX2) pd_gemm_qdot took 0.4-0.8x the tile's time at 1 to 256
 * rows (benchmarks/cpu_linear_quant.py); prefill keeps the tile so that prompt logits (and
 * the first token) are exactly float32's on the dequantized weights.
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
 * pd_gemm_qdot's arithmetic, per row of x, group g and column: x's group quantized as
 * dx = max |x| * (1 / 127), qx = round-to-nearest-even(x * (127 / max |x|)), sx = sum qx;
 * isum = sum q qx over the group (exact, in int32); then
 *     Q8:  acc += (d dx) isum        Q4: acc += (d dx) (isum - 8 sx)
 *     Q4M: acc += (d dx) isum + m (dx sx)
 * each product and multiply-add rounded to float32 once, groups in order of k. The plain C
 * build (no AVX2) computes the same integers and the same float steps.
 *
 * The tile's weights are computed in float32 exactly as gguf-py dequantizes (one rounding
 * for the product, one more for + m), then enter the same chain of fused multiply-adds as
 * pd_gemm's. Empty asm statements pin each dequantized vector, so that -ffast-math cannot
 * fuse d * q + m into one fused multiply-add or reassociate the scale into the
 * activation's product. The tile takes k slices in whole quads (k0 and kc multiples of 4).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PD_QAVX2 1
#endif

#include "gemm_tile.h"

#define NR PD_NR
#define QG PD_QGROUP
#define QUADS (QG / 4)
#define ROW_TILE 4                 /* rows of x per pass of pd_gemm_qdot over a panel */
#define PARALLEL_MIN_MACS 65536    /* as pd_gemm's: below this one thread */
#define AI inline __attribute__((always_inline))

void pd_silu_mul_row(const float *g, const float *u, float *o, int64_t n); /* elementwise_cpu.c */

int64_t pd_quant_block_bytes(int kind) {
    switch (kind) {
        case PD_W_Q8: return 2 * NR + QG * NR;
        case PD_W_Q4: return 2 * NR + QG * NR / 2;
        case PD_W_Q4M: return 4 * NR + QG * NR / 2;
        default: return 0;
    }
}

static AI int64_t header_bytes(int kind) { return kind == PD_W_Q4M ? 4 * NR : 2 * NR; }
static AI int64_t quad_bytes(int kind) { return kind == PD_W_Q8 ? 2 * 4 * NR / 2 : 4 * NR / 2; }

/* x's rows quantized per group: codes q [m][k], scales d and code sums s [m][k / 32] */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *s;
} qrows_t;

/* One group of 32 floats: codes, scale, code sum (the header's formulas) */
static void quantize_group(const float *x, int8_t *q, float *d, int32_t *s) {
#ifdef PD_QAVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], a = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i sum = _mm256_setzero_si256(), c[4];
    for (int i = 0; i < 4; i++) { /* cvtps rounds to nearest even (the default MXCSR) */
        c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
        sum = _mm256_add_epi32(sum, c[i]);
    }
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    *s = _mm_cvtsi128_si32(s4);
#else
    float amax = 0.0f;
    for (int i = 0; i < QG; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < QG; i++) {
        q[i] = (int8_t)lrintf(x[i] * id); /* nearest even (the default rounding mode) */
        sum += q[i];
    }
    *s = sum;
#endif
    *d = amax * (1.0f / 127.0f);
}

/* x [m, k] (rows ldx apart) quantized into r; exported for the tests */
int pd_quantize_rows_q8(const float *x, int64_t ldx, int64_t m, int64_t k, int8_t *q, float *d, int32_t *s) {
    if (m < 0 || k <= 0 || k % QG || ldx < k) return 1;
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < k / QG; g++)
            quantize_group(x + i * ldx + g * QG, q + i * k + g * QG, d + i * (k / QG) + g, s + i * (k / QG) + g);
    return 0;
}

#ifdef PD_QAVX2
/* out[i][0:16] = row i's products with one panel (k / 32 blocks at `panel`), rows i < R of
 * r from row r0. R and KIND are constants in each copy. */
static AI void qdot_panel(const int R, const int KIND, int64_t k, const uint8_t *panel, const qrows_t *r, int64_t r0,
                          float out[][NR]) {
    const int64_t nb = k / QG, bb = pd_quant_block_bytes(KIND);
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);
    __m256 acc[ROW_TILE][2];
    for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g++) {
        const uint8_t *blk = panel + g * bb, *data = blk + header_bytes(KIND);
        __m256i is[ROW_TILE][2];
        for (int i = 0; i < R; i++) is[i][0] = is[i][1] = _mm256_setzero_si256();
        for (int t = 0; t < QUADS; t++) {
            const uint8_t *qd = data + t * quad_bytes(KIND);
            if (KIND == PD_W_Q8) { /* |w| by sign(x, w): signed x signed in maddubs' unsigned x signed */
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)qd);
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(qd + 32));
                const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
                for (int i = 0; i < R; i++) {
                    int32_t x4;
                    memcpy(&x4, r->q + (r0 + i) * k + g * QG + 4 * t, 4);
                    const __m256i xb = _mm256_set1_epi32(x4);
                    const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0));
                    const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1));
                    is[i][0] = _mm256_add_epi32(is[i][0], _mm256_madd_epi16(p0, ones));
                    is[i][1] = _mm256_add_epi32(is[i][1], _mm256_madd_epi16(p1, ones));
                }
            } else { /* codes 0..15 unsigned: maddubs directly; 8 quads' int16 sums stay under 2^15 */
                const __m256i v = _mm256_loadu_si256((const __m256i *)qd);
                const __m256i w0 = _mm256_and_si256(v, low), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                for (int i = 0; i < R; i++) {
                    int32_t x4;
                    memcpy(&x4, r->q + (r0 + i) * k + g * QG + 4 * t, 4);
                    const __m256i xb = _mm256_set1_epi32(x4);
                    is[i][0] = _mm256_add_epi16(is[i][0], _mm256_maddubs_epi16(w0, xb));
                    is[i][1] = _mm256_add_epi16(is[i][1], _mm256_maddubs_epi16(w1, xb));
                }
            }
        }
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        for (int i = 0; i < R; i++) {
            const int64_t gi = (r0 + i) * nb + g;
            const __m256 dx = _mm256_set1_ps(r->d[gi]);
            __m256i s0 = is[i][0], s1 = is[i][1];
            if (KIND != PD_W_Q8) {
                s0 = _mm256_madd_epi16(s0, ones);
                s1 = _mm256_madd_epi16(s1, ones);
            }
            if (KIND == PD_W_Q4) {
                const __m256i eight_s = _mm256_set1_epi32(8 * r->s[gi]);
                s0 = _mm256_sub_epi32(s0, eight_s);
                s1 = _mm256_sub_epi32(s1, eight_s);
            }
            acc[i][0] = _mm256_fmadd_ps(_mm256_mul_ps(d0, dx), _mm256_cvtepi32_ps(s0), acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(_mm256_mul_ps(d1, dx), _mm256_cvtepi32_ps(s1), acc[i][1]);
            if (KIND == PD_W_Q4M) {
                const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32)));
                const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 48)));
                const __m256 xs = _mm256_set1_ps(r->d[gi] * (float)r->s[gi]);
                acc[i][0] = _mm256_fmadd_ps(m0, xs, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(m1, xs, acc[i][1]);
            }
        }
    }
    for (int i = 0; i < R; i++) {
        _mm256_storeu_ps(out[i], acc[i][0]);
        _mm256_storeu_ps(out[i] + 8, acc[i][1]);
    }
}

#define QDOT_COPY(R, KIND)                                                                                             \
    static void qdot_##R##_##KIND(int64_t k, const uint8_t *p, const qrows_t *r, int64_t r0, float out[][NR]) {      \
        qdot_panel(R, KIND, k, p, r, r0, out);                                                                         \
    }
#define QDOT_COPIES(KIND) QDOT_COPY(1, KIND) QDOT_COPY(2, KIND) QDOT_COPY(3, KIND) QDOT_COPY(4, KIND)
QDOT_COPIES(2)
QDOT_COPIES(3)
QDOT_COPIES(4)
typedef void (*qdot_fn)(int64_t, const uint8_t *, const qrows_t *, int64_t, float (*)[NR]);
static const qdot_fn qdots[3][ROW_TILE + 1] = {{0, qdot_1_2, qdot_2_2, qdot_3_2, qdot_4_2},
                                               {0, qdot_1_3, qdot_2_3, qdot_3_3, qdot_4_3},
                                               {0, qdot_1_4, qdot_2_4, qdot_3_4, qdot_4_4}};

static void qdot_rows(int kind, int rows, int64_t k, const uint8_t *panel, const qrows_t *r, int64_t r0,
                      float out[][NR]) {
    qdots[kind - PD_W_Q8][rows](k, panel, r, r0, out);
}
#else
static float f16(const uint8_t *p);

/* The plain C reading of the same sums (no AVX2) */
static void qdot_rows(int kind, int rows, int64_t k, const uint8_t *panel, const qrows_t *r, int64_t r0,
                      float out[][NR]) {
    const int64_t nb = k / QG, bb = pd_quant_block_bytes(kind);
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < NR; c++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < nb; g++) {
                const uint8_t *blk = panel + g * bb, *data = blk + header_bytes(kind);
                const int8_t *xq = r->q + (r0 + i) * k + g * QG;
                int32_t isum = 0;
                for (int t = 0; t < QUADS; t++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t *qd = data + t * quad_bytes(kind);
                        const int w = kind == PD_W_Q8 ? (int8_t)qd[32 * (c / 8) + 4 * (c % 8) + j]
                                                      : (c < 8 ? qd[4 * c + j] & 15 : qd[4 * (c - 8) + j] >> 4);
                        isum += w * xq[4 * t + j];
                    }
                const int64_t gi = (r0 + i) * nb + g;
                if (kind == PD_W_Q4) isum -= 8 * r->s[gi];
                acc = fmaf(f16(blk + 2 * c) * r->d[gi], (float)isum, acc);
                if (kind == PD_W_Q4M) acc = fmaf(f16(blk + 2 * NR + 2 * c), r->d[gi] * (float)r->s[gi], acc);
            }
            out[i][c] = acc;
        }
}
#endif

/* Quantized x's rows for m rows of k: one allocation (freed with free(r->q)); 0 when out of memory */
static int alloc_rows(qrows_t *r, int64_t m, int64_t k) {
    const int64_t nb = m * (k / QG);
    r->q = malloc((size_t)(m * k + nb * (int64_t)(sizeof(float) + sizeof(int32_t))));
    if (!r->q) return 0;
    r->d = (float *)(r->q + m * k); /* m k is a multiple of 32: aligned */
    r->s = (int32_t *)(r->d + nb);
    return 1;
}

static int threads_for(int64_t macs, int64_t panels, int num_threads) {
    if (macs < PARALLEL_MIN_MACS) return 1;
    return panels < num_threads ? (int)(panels > 0 ? panels : 1) : num_threads;
}

/* y[0:m, 0:n] = x @ w^T (+ bias) for a quantized weight w (p: its packed panels) by
 * integer dot products (the header). Threads split the panels. Returns 0, 1 (bad
 * arguments) or 2 (out of memory). */
int pd_gemm_qdot(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, const float *bias, float *y,
              int64_t ldy, int64_t n, int num_threads) {
    if (m < 0 || n < 0 || k <= 0 || k % QG || ldx < k || ldy < n || num_threads < 1 || !pd_quant_block_bytes(kind))
        return 1;
    if (m == 0 || n == 0) return 0;
    qrows_t r;
    if (!alloc_rows(&r, m, k)) return 2;
    pd_quantize_rows_q8(x, ldx, m, k, r.q, r.d, r.s);
    const int64_t panels = (n + NR - 1) / NR, pbytes = k / QG * pd_quant_block_bytes(kind);
    const int threads = threads_for(m * n * k, panels, num_threads);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        float out[ROW_TILE][NR];
        for (int64_t j = panels * t / threads; j < panels * (t + 1) / threads; j++) {
            const int ncols = (j + 1) * NR <= n ? NR : (int)(n - j * NR);
            for (int64_t i = 0; i < m; i += ROW_TILE) {
                const int rows = m - i < ROW_TILE ? (int)(m - i) : ROW_TILE;
                qdot_rows(kind, rows, k, (const uint8_t *)p + j * pbytes, &r, i, out);
                for (int ii = 0; ii < rows; ii++)
                    for (int c = 0; c < ncols; c++)
                        y[(i + ii) * ldy + j * NR + c] = out[ii][c] + (bias ? bias[j * NR + c] : 0.0f);
            }
        }
    }
    free(r.q);
    return 0;
}

/* act = silu(x @ gate^T) * (x @ up^T) as pd_gemm_silu, for a quantized [gate; up] weight
 * (inter a multiple of 16) by pd_gemm_qdot's products: gate panel j and up panel inter / 16 + j
 * per pass. */
int pd_gemm_silu_qdot(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, float *act,
                   int64_t lda, int64_t inter, int num_threads) {
    if (m < 0 || k <= 0 || k % QG || inter <= 0 || inter % NR || ldx < k || lda < inter || num_threads < 1
        || !pd_quant_block_bytes(kind))
        return 1;
    if (m == 0) return 0;
    qrows_t r;
    if (!alloc_rows(&r, m, k)) return 2;
    pd_quantize_rows_q8(x, ldx, m, k, r.q, r.d, r.s);
    const int64_t panels = inter / NR, pbytes = k / QG * pd_quant_block_bytes(kind);
    const int threads = threads_for(m * 2 * inter * k, panels, num_threads);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        float g[ROW_TILE][NR], u[ROW_TILE][NR];
        for (int64_t j = panels * t / threads; j < panels * (t + 1) / threads; j++)
            for (int64_t i = 0; i < m; i += ROW_TILE) {
                const int rows = m - i < ROW_TILE ? (int)(m - i) : ROW_TILE;
                qdot_rows(kind, rows, k, (const uint8_t *)p + j * pbytes, &r, i, g);
                qdot_rows(kind, rows, k, (const uint8_t *)p + (panels + j) * pbytes, &r, i, u);
                for (int ii = 0; ii < rows; ii++) pd_silu_mul_row(g[ii], u[ii], act + (i + ii) * lda + j * NR, NR);
            }
    }
    free(r.q);
    return 0;
}

#ifdef PD_QAVX2
#define PIN(v) __asm__("" : "+x"(v))
static AI void store_row(float *yi, __m256 v0, __m256 v1, int accumulate, const float *bias, int ncols) {
    float t[NR];
    if (ncols == NR && !accumulate && !bias) {
        _mm256_storeu_ps(yi, v0);
        _mm256_storeu_ps(yi + 8, v1);
        return;
    }
    _mm256_storeu_ps(t, v0);
    _mm256_storeu_ps(t + 8, v1);
    for (int j = 0; j < ncols; j++) yi[j] = accumulate ? yi[j] + t[j] : t[j] + (bias ? bias[j] : 0.0f);
}

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

#define DECL(i) __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps();
#define STEP(i)                                                                                                        \
    {                                                                                                                  \
        const __m256 a = _mm256_broadcast_ss(xk + (i)*rs);                                                             \
        c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);                                                                     \
        c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);                                                                     \
    }
#define STORE(i) store_row(y + (i)*ldy, c##i##0, c##i##1, accumulate, bias, ncols);
#define ROWS1(F) F(0)
#define ROWS2(F) ROWS1(F) F(1)
#define ROWS3(F) ROWS2(F) F(2)
#define ROWS4(F) ROWS3(F) F(3)
#define ROWS5(F) ROWS4(F) F(4)
#define ROWS6(F) ROWS5(F) F(5)
#define ROWS7(F) ROWS6(F) F(6)
#define ROWS8(F) ROWS7(F) F(7)
/* one row J of the quad: its weights, then every row of x's multiply-adds */
#define QROW(R, KIND, J)                                                                                               \
    {                                                                                                                  \
        __m256 b0, b1;                                                                                                 \
        const float *xk = x + kk + (J);                                                                                \
        weights(KIND, ROW_CODES(KIND, v0, J), ROW_CODES(KIND, v1, J), d0, d1, m0, m1, &b0, &b1);                      \
        ROWS##R(STEP)                                                                                                  \
    }

/* y[0:R, 0:ncols] (+)= x[0:R, 0:kc] @ w[k0:k0 + kc, panel], the panel's blocks at `panel`;
 * x points at column k0 of its first row. KIND is a constant in each copy. */
#define QTILE(R, KIND)                                                                                                 \
    static void qtile##R##_##KIND(int64_t kc, const float *x, int64_t rs, const uint8_t *panel, int64_t k0,       \
                                  float *y, int64_t ldy, int accumulate, const float *bias, int ncols) {              \
        const int64_t bb = pd_quant_block_bytes(KIND), hdr = header_bytes(KIND), qb = quad_bytes(KIND);              \
        ROWS##R(DECL) for (int64_t kk = 0; kk < kc;) {                                                                 \
            const int64_t kg = k0 + kk, end = kk + QG - kg % QG < kc ? kk + QG - kg % QG : kc;                         \
            const uint8_t *blk = panel + kg / QG * bb, *q = blk + hdr + kg % QG / 4 * qb;                              \
            const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));                                  \
            const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));                           \
            __m256 m0 = d0, m1 = d1;                                                                                   \
            if ((KIND) == PD_W_Q4M) {                                                                                  \
                m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32)));                                    \
                m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 48)));                                    \
            }                                                                                                          \
            for (; kk < end; kk += 4, q += qb) {                                                                       \
                __m256i v0 = _mm256_loadu_si256((const __m256i *)q), v1;                                               \
                if ((KIND) == PD_W_Q8)                                                                                 \
                    v1 = _mm256_loadu_si256((const __m256i *)(q + 32));                                                \
                else                                                                                                   \
                    v1 = _mm256_srli_epi32(v0, 4);                                                                     \
                QROW(R, KIND, 0) QROW(R, KIND, 1) QROW(R, KIND, 2) QROW(R, KIND, 3)                                    \
            }                                                                                                          \
        }                                                                                                              \
        ROWS##R(STORE)                                                                                                 \
    }
#define QTILES(KIND) QTILE(1, KIND) QTILE(2, KIND) QTILE(3, KIND) QTILE(4, KIND) QTILE(5, KIND) QTILE(6, KIND) \
    QTILE(7, KIND) QTILE(8, KIND)
QTILES(2)
QTILES(3)
QTILES(4)
typedef void (*qtile_fn)(int64_t, const float *, int64_t, const uint8_t *, int64_t, float *, int64_t, int,
                         const float *, int);
#define TABLE(KIND) {0, qtile1_##KIND, qtile2_##KIND, qtile3_##KIND, qtile4_##KIND, qtile5_##KIND, qtile6_##KIND, \
                     qtile7_##KIND, qtile8_##KIND}
static const qtile_fn qtiles[3][9] = {TABLE(2), TABLE(3), TABLE(4)};

void pd_gemm_tile_q(int kind, int rows, int64_t kc, const float *x, int64_t rs, const uint8_t *panel, int64_t k0,
                    float *y, int64_t ldy, int accumulate, const float *bias, int ncols) {
    qtiles[kind - PD_W_Q8][rows < 1 ? 1 : rows > 8 ? 8 : rows](kc, x, rs, panel, k0, y, ldy, accumulate, bias, ncols);
}
#else
/* Without AVX2 + F16C (a build on another CPU): the same values in plain C. */
static float f16(const uint8_t *p) {
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

static float weight(int kind, const uint8_t *blk, int64_t r, int c) {
    const float d = f16(blk + 2 * c);
    const uint8_t *qd = blk + header_bytes(kind) + r / 4 * quad_bytes(kind);
    if (kind == PD_W_Q8) return d * (float)(int8_t)qd[32 * (c / 8) + 4 * (c % 8) + r % 4];
    const uint8_t b = qd[4 * (c % 8) + r % 4];
    const int q = c < 8 ? b & 15 : b >> 4;
    return kind == PD_W_Q4 ? d * (float)(q - 8) : d * (float)q + f16(blk + 2 * NR + 2 * c);
}

void pd_gemm_tile_q(int kind, int rows, int64_t kc, const float *x, int64_t rs, const uint8_t *panel, int64_t k0,
                    float *y, int64_t ldy, int accumulate, const float *bias, int ncols) {
    const int64_t bb = pd_quant_block_bytes(kind);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < ncols; j++) {
            float acc = 0.0f;
            for (int64_t kk = 0; kk < kc; kk++) {
                const int64_t kg = k0 + kk;
                acc += x[i * rs + kk] * weight(kind, panel + kg / QG * bb, kg % QG, j);
            }
            y[i * ldy + j] = accumulate ? y[i * ldy + j] + acc : acc + (bias ? bias[j] : 0.0f);
        }
}
#endif
