/* The register tiles of the packed GEMM (gemm_cpu.c, whose top explains the panel layout
 * and the summation order): y[0:rows, 0:ncols] (+)= x @ one or two packed panels, one
 * build per instruction set -- AVX-512 (up to 8 rows by two panels), AVX2 + FMA (up to 6
 * rows by one panel; float32 and bf16 also by two panels for the few rows of a decode step),
 * plain C otherwise. Each output is one chain of fused multiply-adds, so the AVX-512 and
 * AVX2 builds give the same bits. Declared in gemm_tile.h, where PD_PANEL_PAIRS and
 * PD_BF16_PAIRS say which kinds have a real two-panel tile in this build.
 * Built by kernels/cpu_native.py with the system C compiler at first use.
 */
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PD_AVX2 1
#endif

#include "bf16.h"
#include "gemm_tile.h"

#define NR PD_NR /* columns per panel; kernels.cpu_native.PANEL */

#if defined(__AVX512F__)
/* AVX-512: a panel's 16 columns are one 16-lane register. The
 * tile is up to 8 rows by two panels (16 of the 32 registers accumulate; per step of k
 * two loads and one broadcast per row for two fused multiply-adds), or by one panel for
 * the last of an odd count and for pd_gemm_tile. Every output is the same chain of fused
 * multiply-adds as on AVX2, so the two builds give the same bits. */
#define MR PD_MR /* rows of x per register tile: 8 */
static inline __attribute__((always_inline)) void store_row(float *yi, __m512 v, int accumulate, const float *bias,
                                                            int ncols) {
    const __mmask16 mask = ncols == NR ? (__mmask16)0xffff : (__mmask16)((1u << ncols) - 1);
    if (accumulate)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, yi));
    else if (bias)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
    _mm512_mask_storeu_ps(yi, mask, v);
}
/* R = 1..8 rows, each a copy with its accumulators named (see the AVX2 tiles) */
#define ROWS1(F) F(0)
#define ROWS2(F) ROWS1(F) F(1)
#define ROWS3(F) ROWS2(F) F(2)
#define ROWS4(F) ROWS3(F) F(3)
#define ROWS5(F) ROWS4(F) F(4)
#define ROWS6(F) ROWS5(F) F(5)
#define ROWS7(F) ROWS6(F) F(6)
#define ROWS8(F) ROWS7(F) F(7)
#define DECL1(i) __m512 c##i = _mm512_setzero_ps();
#define STEP1(i) c##i = _mm512_fmadd_ps(_mm512_set1_ps(x[(i)*rs + kk * ks]), b, c##i);
#define STORE1(i) store_row(y + (i)*ldy, c##i, accumulate, bias, ncols);
#define DECL2(i) __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = _mm512_setzero_ps();
#define STEP2(i)                                                                                                       \
    {                                                                                                                  \
        const __m512 a = _mm512_set1_ps(x[(i)*rs + kk * ks]);                                                          \
        c##i##0 = _mm512_fmadd_ps(a, b0, c##i##0);                                                                     \
        c##i##1 = _mm512_fmadd_ps(a, b1, c##i##1);                                                                     \
    }
#define STORE2(i)                                                                                                      \
    store_row(y + (i)*ldy, c##i##0, accumulate, bias, NR);                                                             \
    store_row(y + (i)*ldy + NR, c##i##1, accumulate, bias ? bias + NR : 0, ncols1);
#define TILES_T(R, SUF, WT, LOADW)                                                                                     \
    static void tile##R##SUF(int64_t kc, const float *x, int64_t rs, int64_t ks, const WT *p, float *y, int64_t ldy,   \
                        int accumulate, const float *bias, int ncols) {                                                \
        ROWS##R(DECL1) for (int64_t kk = 0; kk < kc; kk++) {                                                           \
            const __m512 b = LOADW(p + kk * NR);                                                                       \
            ROWS##R(STEP1)                                                                                             \
        }                                                                                                              \
        ROWS##R(STORE1)                                                                                                \
    }                                                                                                                  \
    static void tile_pair##R##SUF(int64_t kc, const float *x, int64_t rs, int64_t ks, const WT *p0, const WT *p1,      \
                             float *y, int64_t ldy, int accumulate, const float *bias, int ncols1) {                   \
        ROWS##R(DECL2) for (int64_t kk = 0; kk < kc; kk++) {                                                           \
            const __m512 b0 = LOADW(p0 + kk * NR), b1 = LOADW(p1 + kk * NR);                                           \
            ROWS##R(STEP2)                                                                                             \
        }                                                                                                              \
        ROWS##R(STORE2)                                                                                                \
    }
/* a panel row of 16 weights as 16 float32 lanes: float32 as it is, bf16 widened (exact) */
#define LOAD_F32(q) _mm512_loadu_ps(q)
#define LOAD_BF16(q)                                                                                                   \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(q))), 16))
#define TILES(R) TILES_T(R, , float, LOAD_F32) TILES_T(R, _bf16, uint16_t, LOAD_BF16)
TILES(1)
TILES(2)
TILES(3)
TILES(4)
TILES(5)
TILES(6)
TILES(7)
TILES(8)
typedef void (*tile_fn)(int64_t, const float *, int64_t, int64_t, const float *, float *, int64_t, int, const float *,
                        int);
static const tile_fn tiles[MR + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6, tile7, tile8};
/* y[0:rows, 0:16 + ncols1] (+)= x @ [panel p0 | panel p1], rows <= MR */
typedef void (*pair_fn)(int64_t, const float *, int64_t, int64_t, const float *, const float *, float *, int64_t, int,
                        const float *, int);
static const pair_fn pairs[MR + 1] = {0,          tile_pair1, tile_pair2, tile_pair3, tile_pair4,
                                          tile_pair5, tile_pair6, tile_pair7, tile_pair8};
typedef void (*tile_bf16_fn)(int64_t, const float *, int64_t, int64_t, const uint16_t *, float *, int64_t, int,
                             const float *, int);
static const tile_bf16_fn tiles_bf16[MR + 1] = {0,          tile1_bf16, tile2_bf16, tile3_bf16, tile4_bf16,
                                                tile5_bf16, tile6_bf16, tile7_bf16, tile8_bf16};
typedef void (*pair_bf16_fn)(int64_t, const float *, int64_t, int64_t, const uint16_t *, const uint16_t *, float *,
                             int64_t, int, const float *, int);
static const pair_bf16_fn pairs_bf16[MR + 1] = {0,               tile_pair1_bf16, tile_pair2_bf16, tile_pair3_bf16,
                                                tile_pair4_bf16, tile_pair5_bf16, tile_pair6_bf16, tile_pair7_bf16,
                                                tile_pair8_bf16};

void pd_gemm_tile2_bf16(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const uint16_t *p0,
                        const uint16_t *p1, float *y, int64_t ldy, int accumulate, const float *bias, int ncols1) {
    pairs_bf16[rows < 1 ? 1 : rows](kc, x, rs, ks, p0, p1, y, ldy, accumulate, bias, ncols1);
}

void pd_gemm_tile_bf16(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const uint16_t *p, float *y,
                       int64_t ldy, int accumulate, const float *bias, int ncols) {
    tiles_bf16[rows < 1 ? 1 : rows](kc, x, rs, ks, p, y, ldy, accumulate, bias, ncols);
}

void pd_gemm_tile2(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const float *p0, const float *p1,
                   float *y, int64_t ldy, int accumulate, const float *bias, int ncols1) {
    pairs[rows < 1 ? 1 : rows](kc, x, rs, ks, p0, p1, y, ldy, accumulate, bias, ncols1);
}

void pd_gemm_tile(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const float *p, float *y, int64_t ldy,
                  int accumulate, const float *bias, int ncols) {
    tiles[rows < 1 ? 1 : rows](kc, x, rs, ks, p, y, ldy, accumulate, bias, ncols);
}
#elif defined(PD_AVX2)
#define MR PD_MR /* rows of x per register tile */
static inline __attribute__((always_inline)) void store_row(float *yi, __m256 v0, __m256 v1, int accumulate,
                                                            const float *bias, int ncols) {
    if (ncols == NR) {
        if (accumulate) {
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(yi));
            v1 = _mm256_add_ps(v1, _mm256_loadu_ps(yi + 8));
        } else if (bias) {
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(bias));
            v1 = _mm256_add_ps(v1, _mm256_loadu_ps(bias + 8));
        }
        _mm256_storeu_ps(yi, v0);
        _mm256_storeu_ps(yi + 8, v1);
        return;
    }
    float t[NR];
    _mm256_storeu_ps(t, v0);
    _mm256_storeu_ps(t + 8, v1);
    for (int j = 0; j < ncols; j++) yi[j] = accumulate ? yi[j] + t[j] : t[j] + (bias ? bias[j] : 0.0f);
}

/* One register tile: y[0:R, 0:ncols] (+)= x[0:R, 0:kc] @ panel[0:kc, 0:ncols], for R = 1..6
 * rows, each a copy with its accumulators named (an array of them is kept in memory
 * by gcc, at half the speed). */
#define DECL(i) __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps();
#define STEP(i)                                                                                                        \
    {                                                                                                                  \
        const __m256 a = _mm256_broadcast_ss(x + (i)*rs + kk * ks);                                                    \
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
#define TILE_T(R, SUF, WT, LOAD2, FIX)                                                                                 \
    static void tile##R##SUF(int64_t kc, const float *x, int64_t rs, int64_t ks, const WT *p, float *y, int64_t ldy, \
                             int accumulate, const float *bias, int ncols) {                                           \
        ROWS##R(DECL) for (int64_t kk = 0; kk < kc; kk++) {                                                            \
            LOAD2(p + kk * NR, b0, b1)                                                                                 \
            ROWS##R(STEP)                                                                                              \
        }                                                                                                              \
        ROWS##R(FIX) ROWS##R(STORE)                                                                                    \
    }
/* A panel row's 16 weights as two registers of 8 float32 lanes. float32: columns 0-7 and
   8-15. bf16: one 32-byte load, whose 32-bit lanes each hold columns 2j (low half) and
   2j + 1 (high half): shifted left 16 they are the even columns, masked the odd ones
   (exact), two cheap ops where widening each half (vpmovzxwd + shift) takes four on
   Zen 1; the accumulators then hold even and odd columns, put back in order once per
   tile (UNZIP), not once per step of k. Each column's chain of fused multiply-adds is
   the float32 kernel's on the widened weight: the same bits.
   bf16 panels are also prefetched BF16_AHEAD bytes ahead of their loads: a one-row tile
   issues a panel row's load per multiply-add latency, so the loads the core keeps in
   flight cover too few bytes of a stream of 16-bit weights to hide the memory's latency
   (the hardware prefetcher also stops at each 4 KB page edge, and the smaller bf16
   matrices are under a huge page). Measured on Zen 3 with SmolLM2's shapes: 512-1024
   bytes best, 2048 and up slower. */
#define BF16_AHEAD 1024
/* float32 one-panel tiles (6 rows and more on AVX2: a verification's k + 1 rows, a decode batch, a
   prefill chunk) prefetch into L2 the line one panel slice (KC = 192 steps of k, 12 KB)
   ahead of each load: the memory then fetches the next slice while the tile, and every
   other row tile after it on the same slice (7 rows: 6 + 1), compute on this one, which
   they otherwise do one after the other. Measured on Zen 3 against no prefetch, the builds
   alternated in one process (benchmarks/cpu_kernels/native_ab.py --dtype float32, the small
   qwen3, one thread): 6 / 7 / 8 / 16 rows 1.18 / 1.33 / 1.27 / 1.19x, 1 / 4 / 64 / 256 rows
   0.98-1.06x; a prefetch 1 KB ahead into L1 gained about half of that, 6 KB ahead 0.92-0.96x
   of 12 KB, 24 KB the same. bf16 tiles gained nothing from it. */
#define F32_AHEAD 12288
#define LOAD2_F32(q, b0, b1) const __m256 b0 = _mm256_loadu_ps(q), b1 = _mm256_loadu_ps((q) + 8);
#define LOAD2_F32_AHEAD(q, b0, b1)                                                                                     \
    _mm_prefetch((const char *)(q) + F32_AHEAD, _MM_HINT_T1);                                                          \
    LOAD2_F32(q, b0, b1)
#define LOAD2_BF16(q, b0, b1)                                                                                          \
    _mm_prefetch((const char *)(q) + BF16_AHEAD, _MM_HINT_T0);                                                         \
    const __m256i b0##w = _mm256_loadu_si256((const __m256i *)(q));                                                    \
    const __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(b0##w, 16));                                               \
    const __m256 b1 = _mm256_castsi256_ps(_mm256_and_si256(b0##w, _mm256_set1_epi32((int)0xffff0000u)));
static inline __attribute__((always_inline)) void unzip(__m256 *even, __m256 *odd) {
    const __m256 lo = _mm256_unpacklo_ps(*even, *odd), hi = _mm256_unpackhi_ps(*even, *odd);
    *even = _mm256_permute2f128_ps(lo, hi, 0x20); /* columns 0-7 */
    *odd = _mm256_permute2f128_ps(lo, hi, 0x31);  /* columns 8-15 */
}
#define KEEP(i)
#define UNZIP(i) unzip(&c##i##0, &c##i##1);
#define TILE(R) TILE_T(R, , float, LOAD2_F32_AHEAD, KEEP) TILE_T(R, _bf16, uint16_t, LOAD2_BF16, UNZIP)
TILE(6)
TILE(5)
TILE(4)
TILE(3)
TILE(2)
TILE(1)

/* bf16 by two panels at once, for the few rows of a decode step. A row's chains
   of fused multiply-adds (two per panel) each wait a multiply-add's latency per step of
   k, so one row by one bf16 panel consumes 32 bytes of w per latency: about 20 GB/s on
   Zen 3, near the memory's own rate, which it then does not reach; float32 panels carry
   twice the bytes per step. Two panels give a row four independent chains and 64 bytes
   per step; every output's chain is unchanged (the same bits). */
#define DECL_P(i) DECL(i) __m256 e##i##0 = _mm256_setzero_ps(), e##i##1 = _mm256_setzero_ps();
#define STEP_P(i)                                                                                                      \
    {                                                                                                                  \
        const __m256 a = _mm256_broadcast_ss(x + (i)*rs + kk * ks);                                                    \
        c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);                                                                     \
        c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);                                                                     \
        e##i##0 = _mm256_fmadd_ps(a, f0, e##i##0);                                                                     \
        e##i##1 = _mm256_fmadd_ps(a, f1, e##i##1);                                                                     \
    }
#define UNZIP_P(i) unzip(&c##i##0, &c##i##1); unzip(&e##i##0, &e##i##1);
#define STORE_P(i)                                                                                                     \
    store_row(y0 + (i)*ldy, c##i##0, c##i##1, accumulate, bias0, ncols0);                                              \
    store_row(y1 + (i)*ldy, e##i##0, e##i##1, accumulate, bias1, ncols1);
/* p0's columns to y0 (bias0, ncols0), p1's to y1 (bias1, ncols1), wherever they lie; bf16
   panels unzipped as TILE_T's, float32 ones kept. float32 by two panels too: a decode row
   has two streams in flight where one panel at a time leaves the memory idle between its
   loads. */
#define PAIR_T(R, SUF, WT, LOAD2, FIX)                                                                                 \
    static void tile_pair##R##SUF(int64_t kc, const float *x, int64_t rs, int64_t ks, const WT *p0, const WT *p1,     \
                                  float *y0, float *y1, int64_t ldy, int accumulate, const float *bias0,               \
                                  const float *bias1, int ncols0, int ncols1) {                                        \
        ROWS##R(DECL_P) for (int64_t kk = 0; kk < kc; kk++) {                                                          \
            LOAD2(p0 + kk * NR, b0, b1)                                                                                \
            LOAD2(p1 + kk * NR, f0, f1)                                                                                \
            ROWS##R(STEP_P)                                                                                            \
        }                                                                                                              \
        ROWS##R(FIX) ROWS##R(STORE_P)                                                                                  \
    }
PAIR_T(1, _bf16, uint16_t, LOAD2_BF16, UNZIP_P)
PAIR_T(2, _bf16, uint16_t, LOAD2_BF16, UNZIP_P) /* 8 accumulators; 3 rows measured no faster */
PAIR_T(1, _f32, float, LOAD2_F32, KEEP)
PAIR_T(2, _f32, float, LOAD2_F32, KEEP)
PAIR_T(3, _f32, float, LOAD2_F32, KEEP)

void pd_gemm_tile(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const float *p, float *y, int64_t ldy,
                  int accumulate, const float *bias, int ncols) {
    switch (rows) {
        case 6: tile6(kc, x, rs, ks, p, y, ldy, accumulate, bias, ncols); break;
        case 5: tile5(kc, x, rs, ks, p, y, ldy, accumulate, bias, ncols); break;
        case 4: tile4(kc, x, rs, ks, p, y, ldy, accumulate, bias, ncols); break;
        case 3: tile3(kc, x, rs, ks, p, y, ldy, accumulate, bias, ncols); break;
        case 2: tile2(kc, x, rs, ks, p, y, ldy, accumulate, bias, ncols); break;
        default: tile1(kc, x, rs, ks, p, y, ldy, accumulate, bias, ncols);
    }
}

void pd_gemm_tile_bf16(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const uint16_t *p, float *y,
                       int64_t ldy, int accumulate, const float *bias, int ncols) {
    switch (rows) {
        case 6: tile6_bf16(kc, x, rs, ks, p, y, ldy, accumulate, bias, ncols); break;
        case 5: tile5_bf16(kc, x, rs, ks, p, y, ldy, accumulate, bias, ncols); break;
        case 4: tile4_bf16(kc, x, rs, ks, p, y, ldy, accumulate, bias, ncols); break;
        case 3: tile3_bf16(kc, x, rs, ks, p, y, ldy, accumulate, bias, ncols); break;
        case 2: tile2_bf16(kc, x, rs, ks, p, y, ldy, accumulate, bias, ncols); break;
        default: tile1_bf16(kc, x, rs, ks, p, y, ldy, accumulate, bias, ncols);
    }
}

void pd_gemm_tile2_apart_bf16(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const uint16_t *p0,
                              const uint16_t *p1, float *y0, float *y1, int64_t ldy, int accumulate,
                              const float *bias0, const float *bias1, int ncols0, int ncols1) {
    if (rows <= 1)
        tile_pair1_bf16(kc, x, rs, ks, p0, p1, y0, y1, ldy, accumulate, bias0, bias1, ncols0, ncols1);
    else if (rows == 2)
        tile_pair2_bf16(kc, x, rs, ks, p0, p1, y0, y1, ldy, accumulate, bias0, bias1, ncols0, ncols1);
    else {
        pd_gemm_tile_bf16(rows, kc, x, rs, ks, p0, y0, ldy, accumulate, bias0, ncols0);
        pd_gemm_tile_bf16(rows, kc, x, rs, ks, p1, y1, ldy, accumulate, bias1, ncols1);
    }
}

void pd_gemm_tile2_apart(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const float *p0,
                         const float *p1, float *y0, float *y1, int64_t ldy, int accumulate, const float *bias0,
                         const float *bias1, int ncols0, int ncols1) {
    if (rows <= 1)
        tile_pair1_f32(kc, x, rs, ks, p0, p1, y0, y1, ldy, accumulate, bias0, bias1, ncols0, ncols1);
    else if (rows == 2)
        tile_pair2_f32(kc, x, rs, ks, p0, p1, y0, y1, ldy, accumulate, bias0, bias1, ncols0, ncols1);
    else if (rows == 3)
        tile_pair3_f32(kc, x, rs, ks, p0, p1, y0, y1, ldy, accumulate, bias0, bias1, ncols0, ncols1);
    else if (rows <= 5) { /* three rows, then the rest on the same slices (in L1 now) */
        tile_pair3_f32(kc, x, rs, ks, p0, p1, y0, y1, ldy, accumulate, bias0, bias1, ncols0, ncols1);
        pd_gemm_tile2_apart(rows - 3, kc, x + 3 * rs, rs, ks, p0, p1, y0 + 3 * ldy, y1 + 3 * ldy, ldy, accumulate,
                            bias0, bias1, ncols0, ncols1);
    } else {
        pd_gemm_tile(rows, kc, x, rs, ks, p0, y0, ldy, accumulate, bias0, ncols0);
        pd_gemm_tile(rows, kc, x, rs, ks, p1, y1, ldy, accumulate, bias1, ncols1);
    }
}

void pd_gemm_tile2_bf16(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const uint16_t *p0,
                        const uint16_t *p1, float *y, int64_t ldy, int accumulate, const float *bias, int ncols1) {
    pd_gemm_tile2_apart_bf16(rows, kc, x, rs, ks, p0, p1, y, y + NR, ldy, accumulate, bias, bias ? bias + NR : 0, NR,
                             ncols1);
}
#else
/* Without AVX2 (a build on another CPU): the same loops in plain C. */
#define MR PD_MR
void pd_gemm_tile(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const float *p, float *y, int64_t ldy,
                  int accumulate, const float *bias, int ncols) {
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < ncols; j++) {
            float acc = 0.0f;
            for (int64_t kk = 0; kk < kc; kk++) acc += x[i * rs + kk * ks] * p[kk * NR + j];
            y[i * ldy + j] = accumulate ? y[i * ldy + j] + acc : acc + (bias ? bias[j] : 0.0f);
        }
}

void pd_gemm_tile_bf16(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const uint16_t *p, float *y,
                       int64_t ldy, int accumulate, const float *bias, int ncols) {
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < ncols; j++) {
            float acc = 0.0f;
            for (int64_t kk = 0; kk < kc; kk++) acc += x[i * rs + kk * ks] * pd_bf16_to_f32(p[kk * NR + j]);
            y[i * ldy + j] = accumulate ? y[i * ldy + j] + acc : acc + (bias ? bias[j] : 0.0f);
        }
}
#endif

#if defined(PD_BF16_PAIRS)
/* AVX2: pair tiles for up to 5 rows (SwiGLU's gate and up panels of a decode batch), two
   one-panel tiles for more */
void pd_gemm_tile2(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const float *p0, const float *p1,
                   float *y, int64_t ldy, int accumulate, const float *bias, int ncols1) {
    pd_gemm_tile2_apart(rows, kc, x, rs, ks, p0, p1, y, y + NR, ldy, accumulate, bias, bias ? bias + NR : 0, NR,
                        ncols1);
}
#elif !defined(PD_PANEL_PAIRS)
void pd_gemm_tile2(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const float *p0, const float *p1,
                   float *y, int64_t ldy, int accumulate, const float *bias, int ncols1) {
    pd_gemm_tile(rows, kc, x, rs, ks, p0, y, ldy, accumulate, bias, NR);
    pd_gemm_tile(rows, kc, x, rs, ks, p1, y + NR, ldy, accumulate, bias ? bias + NR : 0, ncols1);
}
#endif

#if !defined(PD_PANEL_PAIRS) && !defined(PD_BF16_PAIRS)
void pd_gemm_tile2_bf16(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const uint16_t *p0,
                        const uint16_t *p1, float *y, int64_t ldy, int accumulate, const float *bias, int ncols1) {
    pd_gemm_tile_bf16(rows, kc, x, rs, ks, p0, y, ldy, accumulate, bias, NR);
    pd_gemm_tile_bf16(rows, kc, x, rs, ks, p1, y + NR, ldy, accumulate, bias ? bias + NR : 0, ncols1);
}
#endif
