/* bf16 weight panels by every row of a decode batch at once (kernels/csrc/gemm_cpu.c's
 * run_panels and gemm_silu call it for bf16 panels and PD_MR < m <= PD_ROWS_MAX rows).
 *
 * Why: gemm_cpu.c runs a panel's k slice row tile by row tile (6 rows on AVX2). The first
 * tile streams the slice's bf16 weights from memory; the tiles after it read them from L1,
 * and the memory sits idle meanwhile. At 7-24 rows, the size of a batched decode step,
 * the time is then about (weights / bandwidth) + (the other tiles' arithmetic), where it
 * could be the larger of the two. Here a slice is cut into sub-slices of SUB steps of k
 * (SUB * 16 weights, 1 KB of bf16 per panel), and every row tile runs over one sub-slice
 * before any moves to the next; each weight load asks for the same place one sub-slice on
 * (prefetch), so the next KB streams in while all the rows work on this one.
 *
 * The same bits: a tile's accumulators are saved to a scratch of [m][two panels][16]
 * floats between sub-slices and loaded back, so each output is still one chain of fused
 * multiply-adds over the slice's k from zero, in order (a float's store and load are
 * exact), added into y as gemm_cpu.c's tiles do (bias first, then slice by slice). The
 * product equals pd_gemm_bf16's on any row count, and pd_gemm's on the widened weight.
 * Scratch columns are kept as the AVX2 tiles hold them (even columns, then odd: see
 * LOAD2_BF16 in gemm_cpu.c), put in order once at the end.
 *
 * AVX2 builds (without AVX-512) only: AVX-512 and plain-C builds run gemm_cpu.c's own
 * tiles, row tile by row tile, through the same entry point.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define PD_ROWS_AVX2 1
#endif

#include "gemm_tile.h"

#define NR PD_NR
#define MR PD_MR

void pd_gemm_tile_bf16(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const uint16_t *p, float *y,
                       int64_t ldy, int accumulate, const float *bias, int ncols);
void pd_gemm_tile2_bf16(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const uint16_t *p0,
                        const uint16_t *p1, float *y, int64_t ldy, int accumulate, const float *bias, int ncols1);

#ifdef PD_ROWS_AVX2
#define SUB 32                       /* k steps per sub-slice */
#define AHEAD (SUB * NR * 2)         /* bytes: the same place in the next sub-slice */
#define LA (2 * NR)                  /* scratch floats per row: two panels of 16 */

#define RROWS1(F) F(0)
#define RROWS2(F) RROWS1(F) F(1)
#define RROWS3(F) RROWS2(F) F(2)
#define RROWS4(F) RROWS3(F) F(3)
#define RROWS5(F) RROWS4(F) F(4)
#define RROWS6(F) RROWS5(F) F(5)
#define RLOAD(i) __m256 c##i##0 = _mm256_loadu_ps(acc + (i)*LA), c##i##1 = _mm256_loadu_ps(acc + (i)*LA + 8);
#define RSTEP(i)                                                                                                       \
    {                                                                                                                  \
        const __m256 a = _mm256_broadcast_ss(x + (i)*ldx + kk);                                                        \
        c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);                                                                     \
        c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);                                                                     \
    }
#define RSAVE(i)                                                                                                       \
    _mm256_storeu_ps(acc + (i)*LA, c##i##0);                                                                           \
    _mm256_storeu_ps(acc + (i)*LA + 8, c##i##1);
/* R rows by one panel over n <= SUB steps of k, the accumulators taken from and put back
   to acc ([R][LA]); a panel row's 32-bit lanes widened as in gemm_cpu.c: shifted left 16
   they are the even columns, masked the odd ones (exact) */
#define RTILE(R)                                                                                                       \
    static void rtile##R(int64_t n, const float *x, int64_t ldx, const uint16_t *p, float *acc) {                      \
        RROWS##R(RLOAD) for (int64_t kk = 0; kk < n; kk++) {                                                           \
            const uint16_t *q = p + kk * NR;                                                                           \
            _mm_prefetch((const char *)q + AHEAD, _MM_HINT_T0);                                                        \
            const __m256i w = _mm256_loadu_si256((const __m256i *)q);                                                  \
            const __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));                                          \
            const __m256 b1 = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));          \
            RROWS##R(RSTEP)                                                                                            \
        }                                                                                                              \
        RROWS##R(RSAVE)                                                                                                \
    }
RTILE(1)
RTILE(2)
RTILE(3)
RTILE(4)
RTILE(5)
RTILE(6)
typedef void (*rtile_fn)(int64_t, const float *, int64_t, const uint16_t *, float *);
static const rtile_fn rtiles[MR + 1] = {0, rtile1, rtile2, rtile3, rtile4, rtile5, rtile6};

/* y[i, 0:ncols] (+)= the scratch's 16 columns of one row and panel, put in order */
static void put_row(float *yi, const float *a, int accumulate, const float *bias, int ncols) {
    const __m256 even = _mm256_loadu_ps(a), odd = _mm256_loadu_ps(a + 8);
    const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
    float t[NR];
    _mm256_storeu_ps(t, _mm256_permute2f128_ps(lo, hi, 0x20));     /* columns 0-7 */
    _mm256_storeu_ps(t + 8, _mm256_permute2f128_ps(lo, hi, 0x31)); /* columns 8-15 */
    for (int j = 0; j < ncols; j++) yi[j] = accumulate ? yi[j] + t[j] : t[j] + (bias ? bias[j] : 0.0f);
}

void pd_gemm_rows_bf16(int64_t m, int64_t kc, const float *x, int64_t ldx, const uint16_t *p0, const uint16_t *p1,
                       float *y, int64_t ldy, int accumulate, const float *bias, int ncols) {
    float acc[PD_ROWS_MAX * LA]; /* [m][panel 0 | panel 1], the accumulators between sub-slices */
    const int two = p1 != 0;
    memset(acc, 0, sizeof(float) * (size_t)(m * LA));
    for (int64_t s0 = 0; s0 < kc; s0 += SUB) {
        const int64_t n = kc - s0 < SUB ? kc - s0 : SUB;
        for (int panel = 0; panel <= two; panel++) {
            const uint16_t *q = (panel ? p1 : p0) + s0 * NR;
            for (int64_t i = 0; i < m; i += MR)
                rtiles[m - i < MR ? m - i : MR](n, x + i * ldx + s0, ldx, q, acc + i * LA + panel * NR);
        }
    }
    for (int64_t i = 0; i < m; i++) {
        put_row(y + i * ldy, acc + i * LA, accumulate, bias, two ? NR : ncols);
        if (two) put_row(y + i * ldy + NR, acc + i * LA + NR, accumulate, bias ? bias + NR : 0, ncols);
    }
}
#else
/* gemm_cpu.c's own tiles, row tile by row tile (one pair tile per row tile on AVX-512) */
void pd_gemm_rows_bf16(int64_t m, int64_t kc, const float *x, int64_t ldx, const uint16_t *p0, const uint16_t *p1,
                       float *y, int64_t ldy, int accumulate, const float *bias, int ncols) {
    for (int64_t i = 0; i < m; i += MR) {
        const int rows = m - i < MR ? (int)(m - i) : MR;
        if (p1)
            pd_gemm_tile2_bf16(rows, kc, x + i * ldx, ldx, 1, p0, p1, y + i * ldy, ldy, accumulate, bias, ncols);
        else
            pd_gemm_tile_bf16(rows, kc, x + i * ldx, ldx, 1, p0, y + i * ldy, ldy, accumulate, bias, ncols);
    }
}
#endif
