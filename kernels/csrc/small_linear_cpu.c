/* y = x @ w^T (+ bias) on CPU for a few rows of x: the decode step's linear layers.
 *
 * float32 only:
 *   x     [m, k]  rows `ldx` apart, unit stride along k
 *   w     [n, k]  rows `ldw` apart, unit stride along k (nn.Linear's own layout)
 *   bias  [n]     contiguous, or NULL
 *   y     [m, n]  rows `ldy` apart, written
 *
 * Why: with a handful of rows (a decode batch) the product is bound by reading w once
 * from memory, and MKL's sgemm reads it at a fraction of the memory bandwidth there
 * (6-13 GB/s against ~23 measured at m = 1-8 on the 2-core AVX2 machine). Here each
 * thread streams one contiguous run of w's rows: a tile of 4 rows is read from memory
 * once, then stays in L1 while every row pair of x is dotted with it (4 x 2 accumulators
 * of 8 lanes, fused multiply-add). Threads split the rows of w in equal contiguous runs.
 * Built by kernels/cpu_native.py with the system C compiler at first use.
 */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PD_AVX2 1
#endif

#define TILE_N 4
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 2
#endif

#ifdef PD_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Dot products of rows w[0..r) with x rows x0 (and x1 unless NULL), r <= TILE_N. */
static inline void dots(const float *const *wr, int r, const float *x0, const float *x1, int64_t k,
                        float out0[TILE_N], float out1[TILE_N]) {
    int64_t i = 0;
#ifdef PD_AVX2
    if (r == TILE_N) {
        __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(), a02 = _mm256_setzero_ps(), a03 = _mm256_setzero_ps();
        __m256 a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps(), a12 = _mm256_setzero_ps(), a13 = _mm256_setzero_ps();
        const float *w0 = wr[0], *w1 = wr[1], *w2 = wr[2], *w3 = wr[3];
        if (x1) {
            for (; i + 8 <= k; i += 8) {
                const __m256 v0 = _mm256_loadu_ps(w0 + i), v1 = _mm256_loadu_ps(w1 + i);
                const __m256 v2 = _mm256_loadu_ps(w2 + i), v3 = _mm256_loadu_ps(w3 + i);
                const __m256 p = _mm256_loadu_ps(x0 + i);
                a00 = _mm256_fmadd_ps(v0, p, a00); a01 = _mm256_fmadd_ps(v1, p, a01);
                a02 = _mm256_fmadd_ps(v2, p, a02); a03 = _mm256_fmadd_ps(v3, p, a03);
                const __m256 q = _mm256_loadu_ps(x1 + i);
                a10 = _mm256_fmadd_ps(v0, q, a10); a11 = _mm256_fmadd_ps(v1, q, a11);
                a12 = _mm256_fmadd_ps(v2, q, a12); a13 = _mm256_fmadd_ps(v3, q, a13);
            }
        } else {
            for (; i + 8 <= k; i += 8) {
                const __m256 p = _mm256_loadu_ps(x0 + i);
                a00 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), p, a00);
                a01 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), p, a01);
                a02 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), p, a02);
                a03 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), p, a03);
            }
        }
        out0[0] = hsum(a00); out0[1] = hsum(a01); out0[2] = hsum(a02); out0[3] = hsum(a03);
        out1[0] = hsum(a10); out1[1] = hsum(a11); out1[2] = hsum(a12); out1[3] = hsum(a13);
    } else {
        for (int j = 0; j < r; j++) {
            __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
            int64_t t = 0;
            for (; t + 8 <= k; t += 8) {
                const __m256 v = _mm256_loadu_ps(wr[j] + t);
                a = _mm256_fmadd_ps(v, _mm256_loadu_ps(x0 + t), a);
                if (x1) b = _mm256_fmadd_ps(v, _mm256_loadu_ps(x1 + t), b);
            }
            out0[j] = hsum(a);
            out1[j] = hsum(b);
        }
        i = k - k % 8;
    }
#else
    for (int j = 0; j < r; j++) out0[j] = out1[j] = 0.0f;
#endif
    for (int j = 0; j < r; j++) { /* the tail past the last full 8 lanes (all of k without AVX2) */
        float s0 = 0.0f, s1 = 0.0f;
        for (int64_t t = i; t < k; t++) {
            s0 += wr[j][t] * x0[t];
            if (x1) s1 += wr[j][t] * x1[t];
        }
        out0[j] += s0;
        out1[j] += s1;
    }
}

static void run_rows(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t k,
                     int64_t ldx, int64_t ldw, int64_t ldy, int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; j += TILE_N) {
        const int r = (int)(end - j < TILE_N ? end - j : TILE_N);
        const float *wr[TILE_N];
        for (int t = 0; t < TILE_N; t++) wr[t] = w + (j + (t < r ? t : 0)) * ldw;
        /* One core cannot keep enough misses in flight on its own: ask for the tile
           PREFETCH_TILES ahead now, so it streams in while this one is computed. */
        if (j + (PREFETCH_TILES + 1) * TILE_N <= end)
            for (int t = 0; t < TILE_N; t++) {
                const char *row = (const char *)(w + (j + PREFETCH_TILES * TILE_N + t) * ldw);
                for (int64_t off = 0; off < k * (int64_t)sizeof(float); off += 64) __builtin_prefetch(row + off);
            }
        for (int64_t i = 0; i < m; i += 2) {
            const float *x1 = i + 1 < m ? x + (i + 1) * ldx : NULL;
            float o0[TILE_N], o1[TILE_N];
            dots(wr, r, x + i * ldx, x1, k, o0, o1);
            for (int t = 0; t < r; t++) {
                const float b = bias ? bias[j + t] : 0.0f;
                y[i * ldy + j + t] = o0[t] + b;
                if (x1) y[(i + 1) * ldy + j + t] = o1[t] + b;
            }
        }
    }
}

/* One row of x (single-stream decode): nothing to reuse a tile for, so take 8 rows of w
 * at a time, 8 independent streams and accumulators per thread, to keep more of the
 * memory system busy. Rows past the last full 8 go through run_rows. */
static void run_one_row(const float *x, const float *w, const float *bias, float *y, int64_t k, int64_t ldw,
                        int64_t begin, int64_t end) {
    int64_t j = begin;
#ifdef PD_AVX2
    for (; j + 8 <= end; j += 8) {
        if (j + 8 * (PREFETCH_TILES + 1) <= end)
            for (int t = 0; t < 8; t++) {
                const char *row = (const char *)(w + (j + 8 * PREFETCH_TILES + t) * ldw);
                for (int64_t off = 0; off < k * (int64_t)sizeof(float); off += 64) __builtin_prefetch(row + off);
            }
        const float *r0 = w + j * ldw;
        __m256 a[8];
        for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= k; i += 8) {
            const __m256 p = _mm256_loadu_ps(x + i);
            for (int t = 0; t < 8; t++) a[t] = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + t * ldw + i), p, a[t]);
        }
        for (int t = 0; t < 8; t++) {
            float acc = hsum(a[t]);
            for (int64_t q = i; q < k; q++) acc += r0[t * ldw + q] * x[q];
            y[j + t] = acc + (bias ? bias[j + t] : 0.0f);
        }
    }
#endif
    if (j < end) run_rows(x, w, bias, y, 1, k, k, ldw, 0, j, end);
}

int pd_small_linear(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
                    int64_t ldx, int64_t ldw, int64_t ldy, int num_threads) {
    if (m < 0 || n < 0 || k < 0 || ldx < k || ldw < k || ldy < n || num_threads < 1) return 1;
    if (m == 0 || n == 0) return 0;
    /* Runs of whole tiles, one per thread: each thread streams its own part of w. */
    const int64_t tiles = (n + TILE_N - 1) / TILE_N;
    if (tiles < num_threads) num_threads = (int)tiles;
    /* OpenMP: inside a torch process this is torch's own libgomp and thread pool (same
       soname), so no second pool spins against torch's between calls */
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int t = 0; t < num_threads; t++) {
        const int64_t begin = tiles * t / num_threads * TILE_N;
        int64_t end = tiles * (t + 1) / num_threads * TILE_N;
        if (end > n) end = n;
        if (m == 1)
            run_one_row(x, w, bias, y, k, ldw, begin, end);
        else
            run_rows(x, w, bias, y, m, k, ldx, ldw, ldy, begin, end);
    }
    return 0;
}
