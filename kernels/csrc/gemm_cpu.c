/* y = x @ w^T (+ bias) on CPU, float32, with w pre-packed: every linear layer of the
 * CPU engine, decode batches and prefill chunks alike.
 *
 *   x     [m, k]  rows `ldx` apart, unit stride along k
 *   p     [ceil(n / 16), k, 16]  w [n, k] packed by kernels.cpu_native.pack_weight: panel j
 *         holds output columns 16 j .. 16 j + 15, k-major, zero past n
 *   bias  [n] or NULL
 *   y     [m, n]  rows `ldy` apart, written
 *
 * Why packed: a register tile of 6 rows of x by 16 columns of y (12 accumulators of 8
 * lanes) takes, per step of k, two loads of the panel and six broadcasts of x for 12
 * fused multiply-adds, with no horizontal sums; the panel's slice of KC steps is reused
 * from L1 by every 6-row group of x, and the rows are taken MC at a time so that those
 * of x a panel meets stay in L2. Threads split the panels in equal contiguous runs: each
 * streams its own part of w. Measured against MKL (`F.linear`) and oneDNN on its own
 * packed weight, side by side (benchmarks/cpu_linear.py, the small qwen3's layer, 2
 * threads, Zen 1 AVX2): 1.3-3x MKL and 1.1-1.6x oneDNN at 1-64 rows (a decode batch),
 * 0.95-1x oneDNN from 256 rows (a prefill chunk).
 *
 * Summation order: each output is summed over k in slices, each slice a chain of fused
 * multiply-adds from zero, and the slices' sums added into y in order (the bias first)
 * -- MKL's own order where its blocked sgemm runs (4 or more rows in multiples of 4, or
 * 16 or more): slices of 192, or two equal halves when k is 193-384. The product then
 * equals MKL's, which transformers runs, bit for bit (tests/kernels/test_cpu_native_ops.py),
 * and is the same for a row whatever the other rows of the batch are.
 * Built by kernels/cpu_native.py with the system C compiler at first use.
 */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PD_AVX2 1
#endif

#include "gemm_tile.h"

#define NR PD_NR /* columns per panel; kernels.cpu_native.PANEL */
#define MR PD_MR /* rows of x per register tile */
#define KC 192 /* k per panel slice (12 KB, in L1); MKL's own, see the top */





#ifndef MC
#define MC 96 /* rows of x per block of a prefill chunk */
#endif
#define PARALLEL_MIN_MACS 65536 /* below this one thread is faster than waking two */

#ifdef PD_AVX2
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
#define TILE(R, DECLS, STEPS, STORES)                                                                                  \
    static void tile##R(int64_t kc, const float *x, int64_t rs, int64_t ks, const float *p, float *y, int64_t ldy,   \
                        int accumulate, const float *bias, int ncols) {                                                \
        DECLS                                                                                                          \
        for (int64_t kk = 0; kk < kc; kk++) {                                                                          \
            const __m256 b0 = _mm256_loadu_ps(p + kk * NR), b1 = _mm256_loadu_ps(p + kk * NR + 8);                     \
            STEPS                                                                                                      \
        }                                                                                                              \
        STORES                                                                                                         \
    }
TILE(6, DECL(0) DECL(1) DECL(2) DECL(3) DECL(4) DECL(5), STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5),
     STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5))
TILE(5, DECL(0) DECL(1) DECL(2) DECL(3) DECL(4), STEP(0) STEP(1) STEP(2) STEP(3) STEP(4),
     STORE(0) STORE(1) STORE(2) STORE(3) STORE(4))
TILE(4, DECL(0) DECL(1) DECL(2) DECL(3), STEP(0) STEP(1) STEP(2) STEP(3), STORE(0) STORE(1) STORE(2) STORE(3))
TILE(3, DECL(0) DECL(1) DECL(2), STEP(0) STEP(1) STEP(2), STORE(0) STORE(1) STORE(2))
TILE(2, DECL(0) DECL(1), STEP(0) STEP(1), STORE(0) STORE(1))
TILE(1, DECL(0), STEP(0), STORE(0))

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
#else
/* Without AVX2 (a build on another CPU): the same loops in plain C. */
void pd_gemm_tile(int rows, int64_t kc, const float *x, int64_t rs, int64_t ks, const float *p, float *y, int64_t ldy,
                  int accumulate, const float *bias, int ncols) {
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < ncols; j++) {
            float acc = 0.0f;
            for (int64_t kk = 0; kk < kc; kk++) acc += x[i * rs + kk * ks] * p[kk * NR + j];
            y[i * ldy + j] = accumulate ? y[i * ldy + j] + acc : acc + (bias ? bias[j] : 0.0f);
        }
}
#endif

/* MKL's split of k (see the top): two equal halves up to 2 KC, KC at a time past it. */
static inline int64_t k_step(int64_t k) { return k > KC && k <= 2 * KC ? k / 2 : KC; }

/* Few rows (a decode batch): panels [pb, pe) of y, every row of x read where it lies.
 * A panel's k slices follow each other, so w streams in its own order. */
static void run_panels(const float *x, int64_t ldx, int64_t m, int64_t k, const float *p, const float *bias, float *y,
                       int64_t ldy, int64_t n, int64_t pb, int64_t pe) {
    const int64_t kstep = k_step(k);
    for (int64_t j = pb; j < pe; j++) {
        const int ncols = (j + 1) * NR <= n ? NR : (int)(n - j * NR);
        const float *bj = bias ? bias + j * NR : 0;
        for (int64_t k0 = 0; k0 < k; k0 += kstep) {
            const int64_t kc = k - k0 < kstep ? k - k0 : kstep;
            const float *pj = p + (j * k + k0) * NR;
            for (int64_t i = 0; i < m; i += MR)
                pd_gemm_tile(m - i < MR ? (int)(m - i) : MR, kc, x + i * ldx + k0, ldx, 1, pj, y + i * ldy + j * NR, ldy, k0 > 0,
                     bj, ncols);
        }
    }
}

/* Many rows (a prefill chunk): rows [i0, i1) of y, MC at a time. Each k slice of an MC
 * block of x is copied once into `xp` as [MR-row group][kc][MR], so that a tile's six
 * broadcasts read one cache line, and then meets every panel from L2. The sums are
 * those of run_panels: each output's slices are added in k order. */
static void run_rows(const float *x, int64_t ldx, int64_t i0, int64_t i1, int64_t k, const float *p, const float *bias,
                     float *y, int64_t ldy, int64_t n, float *xp) {
    const int64_t kstep = k_step(k), panels = (n + NR - 1) / NR;
    for (int64_t r0 = i0; r0 < i1; r0 += MC) {
        const int64_t r1 = i1 - r0 < MC ? i1 : r0 + MC;
        for (int64_t k0 = 0; k0 < k; k0 += kstep) {
            const int64_t kc = k - k0 < kstep ? k - k0 : kstep;
            for (int64_t g = r0; g < r1; g += MR) {
                const int64_t rows = r1 - g < MR ? r1 - g : MR;
                float *dst = xp + (g - r0) * kc;
                for (int64_t kk = 0; kk < kc; kk++)
                    for (int64_t i = 0; i < rows; i++) dst[kk * MR + i] = x[(g + i) * ldx + k0 + kk];
            }
            for (int64_t j = 0; j < panels; j++) {
                const int ncols = (j + 1) * NR <= n ? NR : (int)(n - j * NR);
                const float *pj = p + (j * k + k0) * NR, *bj = bias ? bias + j * NR : 0;
                for (int64_t g = r0; g < r1; g += MR)
                    pd_gemm_tile(r1 - g < MR ? (int)(r1 - g) : MR, kc, xp + (g - r0) * kc, 1, MR, pj, y + g * ldy + j * NR, ldy,
                         k0 > 0, bj, ncols);
            }
        }
    }
}

int pd_gemm(const float *x, int64_t ldx, int64_t m, int64_t k, const float *p, const float *bias, float *y,
            int64_t ldy, int64_t n, int num_threads) {
    if (m < 0 || n < 0 || k <= 0 || ldx < k || ldy < n || num_threads < 1) return 1;
    if (m == 0 || n == 0) return 0;
    if (m * n * k < PARALLEL_MIN_MACS) num_threads = 1;
    const int64_t panels = (n + NR - 1) / NR;
    if (m > MC) { /* many rows: threads split them, in whole MR groups */
        const int64_t groups = (m + MR - 1) / MR;
        if (groups < num_threads) num_threads = (int)groups;
        int status = 0;
        /* OpenMP: inside a torch process this is torch's own libgomp and thread pool
           (same soname), so no second pool spins against torch's between calls */
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
        for (int t = 0; t < num_threads; t++) {
            float *xp = malloc(sizeof(float) * MC * KC);
            if (!xp) {
                status = 2;
                continue;
            }
            const int64_t a = groups * t / num_threads * MR, b = groups * (t + 1) / num_threads * MR;
            run_rows(x, ldx, a, b < m ? b : m, k, p, bias, y, ldy, n, xp);
            free(xp);
        }
        return status;
    }
    if (panels < num_threads) num_threads = (int)panels;
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int t = 0; t < num_threads; t++)
        run_panels(x, ldx, m, k, p, bias, y, ldy, n, panels * t / num_threads, panels * (t + 1) / num_threads);
    return 0;
}
