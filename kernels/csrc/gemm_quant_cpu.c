/* The register tile of kernels/csrc/gemm_cpu.c on weight-only quantized panels: int8 and
 * int4 weights with a float16 scale (and, for asymmetric int4, a float16 minimum) per
 * group of 32 values along k, dequantized to float32 in registers as the tile loads them;
 * activations, accumulation and y stay float32.
 *
 * Packed layout (kernels.quant.pack): panel j holds output columns 16 j .. 16 j + 15 (zero
 * past n, as the float panels), as k / 32 blocks of one group each, block g:
 *     scales  16 x fp16        the columns' scales d
 *     mins    16 x fp16        (PD_W_Q4M only) the columns' minimums m
 *     data    32 rows (k = 32 g .. 32 g + 31) of the 16 columns' values:
 *             PD_W_Q8:  16 int8, column c in byte c                         w = d * q
 *             PD_W_Q4:  8 bytes, column c in byte c % 8, low nibble for c < 8,
 *                       high for c >= 8; q in 0..15                         w = d * (q - 8)
 *             PD_W_Q4M: as PD_W_Q4                                          w = d * q + m
 * These are GGUF's Q8_0, Q4_0 and Q4_1 (kernels.quant repacks their blocks as they are)
 * and what `--quantization int8|int4` writes from float weights (int4: Q4_1's form).
 *
 * Each weight is computed in float32 exactly as gguf-py dequantizes (one rounding for the
 * product, one more for + m), then enters the same chain of fused multiply-adds as
 * pd_gemm's: the product equals pd_gemm's on the dequantized weight bit for bit. Empty
 * asm statements pin each dequantized vector, so that -ffast-math cannot fuse d * q + m
 * into one fused multiply-add or reassociate the scale into the activation's product.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PD_QAVX2 1
#endif

#include "gemm_tile.h"

#define NR PD_NR
#define QG PD_QGROUP

int64_t pd_quant_block_bytes(int kind) {
    switch (kind) {
        case PD_W_Q8: return 2 * NR + QG * NR;
        case PD_W_Q4: return 2 * NR + QG * NR / 2;
        case PD_W_Q4M: return 4 * NR + QG * NR / 2;
        default: return 0;
    }
}

#ifdef PD_QAVX2
#define PIN(v) __asm__("" : "+x"(v))
static inline __attribute__((always_inline)) void store_row(float *yi, __m256 v0, __m256 v1, int accumulate,
                                                            const float *bias, int ncols) {
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

/* Two data rows' codes as int8, q4 in 0..15 (minus 8 when centred): row r's columns 0-7
 * in the low 8 bytes of lo (r = 0) or its high 8 bytes (r = 1), columns 8-15 likewise in hi */
static inline __attribute__((always_inline)) void codes2(int kind, const uint8_t *q, __m128i *lo, __m128i *hi) {
    if (kind == PD_W_Q8) { /* rows r: bytes 16 r .. 16 r + 15 */
        const __m128i a = _mm_loadu_si128((const __m128i *)q), b = _mm_loadu_si128((const __m128i *)(q + 16));
        *lo = _mm_unpacklo_epi64(a, b);
        *hi = _mm_unpackhi_epi64(a, b);
        return;
    }
    const __m128i v = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(0x0f);
    *lo = _mm_and_si128(v, low);
    *hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    if (kind == PD_W_Q4) {
        *lo = _mm_sub_epi8(*lo, _mm_set1_epi8(8));
        *hi = _mm_sub_epi8(*hi, _mm_set1_epi8(8));
    }
}

/* The weights of one row from its codes (8 int8 each in the low bytes of c0, c1): d q
 * (+ m), each step rounded as gguf-py rounds it, pinned against contraction */
static inline __attribute__((always_inline)) void weights(int kind, __m128i c0, __m128i c1, __m256 d0, __m256 d1,
                                                          __m256 m0, __m256 m1, __m256 *b0, __m256 *b1) {
    __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c0)), d0);
    __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c1)), d1);
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

/* y[0:R, 0:ncols] (+)= x[0:R, 0:kc] @ w[k0:k0 + kc, panel], the panel's blocks at `panel`;
 * x points at column k0 of its first row. KIND is a constant in each copy. */
#define QTILE(R, KIND)                                                                                                 \
    static void qtile##R##_##KIND(int64_t kc, const float *x, int64_t rs, const uint8_t *panel, int64_t k0,       \
                                  float *y, int64_t ldy, int accumulate, const float *bias, int ncols) {              \
        const int64_t bb = pd_quant_block_bytes(KIND), hdr = (KIND) == PD_W_Q4M ? 4 * NR : 2 * NR;                    \
        const int64_t rowb = (KIND) == PD_W_Q8 ? NR : NR / 2;                                                          \
        ROWS##R(DECL) for (int64_t kk = 0; kk < kc;) {                                                                 \
            const int64_t kg = k0 + kk, end = kk + QG - kg % QG < kc ? kk + QG - kg % QG : kc;                         \
            const uint8_t *blk = panel + kg / QG * bb, *q = blk + hdr + kg % QG * rowb;                                \
            const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));                                  \
            const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));                           \
            __m256 m0 = d0, m1 = d1;                                                                                   \
            if ((KIND) == PD_W_Q4M) {                                                                                  \
                m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32)));                                    \
                m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 48)));                                    \
            }                                                                                                          \
            /* two rows of k per pass (from the GEMM driver a slice's rows of a group are even) */                   \
            for (; kk + 1 < end; kk += 2, q += 2 * rowb) {                                                            \
                __m128i lo, hi;                                                                                        \
                __m256 b0, b1;                                                                                         \
                const float *xk = x + kk;                                                                              \
                codes2(KIND, q, &lo, &hi);                                                                             \
                weights(KIND, lo, hi, d0, d1, m0, m1, &b0, &b1);                                                       \
                ROWS##R(STEP)                                                                                          \
                xk++;                                                                                                  \
                weights(KIND, _mm_srli_si128(lo, 8), _mm_srli_si128(hi, 8), d0, d1, m0, m1, &b0, &b1);                \
                ROWS##R(STEP)                                                                                          \
            }                                                                                                          \
            if (kk < end) { /* an odd last row */                                                                      \
                __m128i lo, hi;                                                                                        \
                __m256 b0, b1;                                                                                         \
                const float *xk = x + kk;                                                                              \
                uint8_t two[32] = {0};                                                                                 \
                memcpy(two, q, (size_t)rowb);                                                                          \
                codes2(KIND, two, &lo, &hi);                                                                           \
                weights(KIND, lo, hi, d0, d1, m0, m1, &b0, &b1);                                                       \
                ROWS##R(STEP)                                                                                          \
                kk++;                                                                                                  \
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
    if (kind == PD_W_Q8) return d * (float)(int8_t)blk[2 * NR + r * NR + c];
    const int64_t hdr = kind == PD_W_Q4M ? 4 * NR : 2 * NR;
    const uint8_t b = blk[hdr + r * NR / 2 + c % 8];
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
