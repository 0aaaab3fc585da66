/* Paged decode attention on CPU, reading K/V blocks in place (no gather copy).
 *
 * Same contract as kernels.reference.paged_decode_attention, float32 only:
 *   q       [B, Hq, D]                       contiguous
 *   k, v    [num_blocks, block_size, Hkv, D] given by element strides (block, token, head)
 *   tables  [B, max_blocks] int32, -1 padded  contiguous; ids < num_blocks
 *   lens    [B] int32                        contiguous
 *   out     [B, Hq, D]                       contiguous, written
 * GQA: query head i uses kv head i / (Hq / Hkv). A sequence with lens[b] == 0 gets zeros.
 *
 * One work item is a sequence (or, with few sequences, one of its kv heads): each K/V
 * block is walked block by block and every query head reads the rows of its kv head.
 * Pass 1 computes the scores into a scratch row per query head, eight keys per chain of
 * fused multiply-adds (on AVX-512, two query heads of a kv head at once on each loaded
 * key), then the softmax; pass 2 accumulates the weighted V rows in registers (on
 * AVX-512 again two query heads per loaded row). Items are split between `num_threads`
 * OpenMP threads in contiguous runs of about equal context length. The CPU engine lays
 * each block out head-major (common.kv_layout), so a head's rows of a block are one run
 * in memory. Blocks lie scattered, so on AVX-512 builds the next blocks are asked for
 * ahead (PREFETCH_AHEAD, below). The kernel is memory-bound: it aims to read K/V as fast
 * as a plain read of the same scattered blocks, and spends no pass on anything else.
 * Built by kernels/cpu_native.py with the system C compiler at first use.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PD_AVX2 1
#endif

#include "bf16.h"

/* The cache's element type kv_t (bf16.h): float32 here; paged_decode_attention_bf16_cpu.c
   compiles this file again with PD_KV_BF16 for a bf16 cache, every K and V value widened
   to float32 as it is loaded (exact), the arithmetic unchanged. */
#ifdef PD_KV_BF16
#define PD_DECODE_ATTENTION pd_paged_decode_attention_bf16
#define KV_LOAD8(x)                                                                                                    \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x))), 16))
#define KV_LOAD16(x)                                                                                                   \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x))), 16))
#else
#define PD_DECODE_ATTENTION pd_paged_decode_attention
#define KV_LOAD8(x) _mm256_loadu_ps(x)
#define KV_LOAD16(x) _mm512_loadu_ps(x)
#endif

#define MAX_THREADS 64
typedef struct {
    const float *q;
    const kv_t *k;
    const kv_t *v;
    const int32_t *tables;
    const int32_t *lens;
    float *out;
    int64_t hq, hkv, d, block_size, max_blocks;
    int64_t k_sb, k_st, k_sh; /* element strides of k: block, token, head */
    int64_t v_sb, v_st, v_sh;
    float scale;
    int64_t max_len; /* longest context: sizes the scratch rows */
    int64_t splits;  /* items per sequence: its kv heads split into this many runs */
} problem_t;

typedef struct {
    const problem_t *p;
    int64_t begin, end; /* work items [begin, end) */
    int status;
} job_t;

#ifdef PD_AVX2
/* lane i = the sum of a_i's eight lanes: 8 dot products reduced in 10 instructions
 * (one hsum each would take ~6 apiece) */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* s[i] = scale * <q, k_i> for the n <= 8 rows k_i = k + i * kst (d a multiple of 8).
 * Eight independent accumulators, one per row: a single dot product is a chain of
 * dependent FMAs (d / 8 of them, ~5 cycles each), eight keep the FMA unit busy. Rows
 * past n repeat the last one and are not stored. */
static inline __attribute__((always_inline)) void dots8(const float *q, const kv_t *k, int64_t kst, int64_t n,
                                                        float scale, float *s, const int64_t d) {
    const kv_t *r[8];
    for (int i = 0; i < 8; i++) r[i] = k + (i < n ? i : n - 1) * kst;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t j = 0; j < d; j += 8) {
        const __m256 qv = _mm256_loadu_ps(q + j);
        a0 = _mm256_fmadd_ps(KV_LOAD8(r[0] + j), qv, a0);
        a1 = _mm256_fmadd_ps(KV_LOAD8(r[1] + j), qv, a1);
        a2 = _mm256_fmadd_ps(KV_LOAD8(r[2] + j), qv, a2);
        a3 = _mm256_fmadd_ps(KV_LOAD8(r[3] + j), qv, a3);
        a4 = _mm256_fmadd_ps(KV_LOAD8(r[4] + j), qv, a4);
        a5 = _mm256_fmadd_ps(KV_LOAD8(r[5] + j), qv, a5);
        a6 = _mm256_fmadd_ps(KV_LOAD8(r[6] + j), qv, a6);
        a7 = _mm256_fmadd_ps(KV_LOAD8(r[7] + j), qv, a7);
    }
    const __m256 sums = _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(scale));
    if (n == 8) {
        _mm256_storeu_ps(s, sums);
    } else {
        float tmp[8];
        _mm256_storeu_ps(tmp, sums);
        for (int64_t i = 0; i < n; i++) s[i] = tmp[i];
    }
}

/* o[0:d] += sum_i w[i] * v_i for the n rows v_i = v + i * vst (d a multiple of 8), in
 * chunks of 64 values whose accumulators stay in registers across the rows. */
static inline __attribute__((always_inline)) void axpy_rows(float *o, const kv_t *v, int64_t vst, const float *w,
                                                            int64_t n, const int64_t d) {
    for (int64_t c = 0; c < d; c += 64) {
        const int64_t nv = d - c < 64 ? (d - c) / 8 : 8;
        __m256 acc[8];
        for (int64_t x = 0; x < nv; x++) acc[x] = _mm256_loadu_ps(o + c + 8 * x);
        for (int64_t i = 0; i < n; i++) {
            const __m256 wi = _mm256_set1_ps(w[i]);
            const kv_t *vi = v + i * vst + c;
            for (int64_t x = 0; x < nv; x++) acc[x] = _mm256_fmadd_ps(wi, KV_LOAD8(vi + 8 * x), acc[x]);
        }
        for (int64_t x = 0; x < nv; x++) _mm256_storeu_ps(o + c + 8 * x, acc[x]);
    }
}
#endif

/* Blocks ahead whose K (in pass 1) or V (pass 2) rows are asked for while the current
 * one is read. Blocks lie scattered in the cache, so the hardware prefetcher starts over
 * at each. On AVX-512 builds the paired loops ask for one line of the block PREFETCH_AHEAD
 * ahead with each line they load (prefetcht2, same offset), so the requests run evenly
 * alongside the arithmetic; asking for a whole block (256 lines) at once at the top of
 * each block stalls the loads behind it. Two blocks ahead, into L2, was the best of 1 to
 * 6. Rows that are not paired (one query head per kv head) still ask for whole blocks.
 * AVX2 builds do not prefetch: on the AVX2 machine it was tried on, at 1-4 blocks ahead,
 * into L1 or L2, it only cost time. */
#if defined(PD_AVX2) && defined(__AVX512F__)
#define PD_AVX512 1
#define PREFETCH_AHEAD 2
#else
#define PREFETCH_AHEAD 0
#endif

/* ask for `bytes` from `base` on into L2, a cache line at a time */
static inline void prefetch_span(const void *base, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)base + off, 0, 2);
}

/* ask for the line holding `x` (prefetcht2) */
static inline __attribute__((always_inline)) void prefetch_line(const void *x) {
    __builtin_prefetch((const char *)x, 0, 1);
}

#ifdef PD_AVX512
/* the sum of a's two 8-lane halves */
static inline __m256 fold(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* Two query rows q0, q1 of one kv head against the same n <= 8 keys: s0[i] = scale *
 * <q0, k_i>, s1[i] = scale * <q1, k_i> (d a multiple of 16). Each key row is loaded once
 * for both (16 accumulators of the 32 registers), which halves the loads of two dots8.
 * With each line loaded, the line at the same offset from `pf` is asked for. */
#define PAIR_DECL(t) __m512 a##t = _mm512_setzero_ps(), b##t = _mm512_setzero_ps();
#define PAIR_STEP(t)                                                                                                   \
    {                                                                                                                  \
        const __m512 kv = KV_LOAD16(r[t] + j);                                                                         \
        a##t = _mm512_fmadd_ps(kv, q0v, a##t);                                                                         \
        b##t = _mm512_fmadd_ps(kv, q1v, b##t);                                                                         \
    }
static inline __attribute__((always_inline)) void dots8_pair(const float *q0, const float *q1, const kv_t *k,
                                                             int64_t kst, int64_t n, float scale, float *s0,
                                                             float *s1, const int64_t d, const kv_t *pf) {
    const kv_t *r[8];
    for (int i = 0; i < 8; i++) r[i] = k + (i < n ? i : n - 1) * kst;
    PAIR_DECL(0) PAIR_DECL(1) PAIR_DECL(2) PAIR_DECL(3) PAIR_DECL(4) PAIR_DECL(5) PAIR_DECL(6) PAIR_DECL(7)
    for (int64_t j = 0; j < d; j += 16) {
        for (int t = 0; t < 8; t++) prefetch_line(pf + t * kst + j);
        const __m512 q0v = _mm512_loadu_ps(q0 + j), q1v = _mm512_loadu_ps(q1 + j);
        PAIR_STEP(0) PAIR_STEP(1) PAIR_STEP(2) PAIR_STEP(3) PAIR_STEP(4) PAIR_STEP(5) PAIR_STEP(6) PAIR_STEP(7)
    }
    const __m256 sc = _mm256_set1_ps(scale);
    const __m256 x0 = _mm256_mul_ps(hsum8(fold(a0), fold(a1), fold(a2), fold(a3), fold(a4), fold(a5), fold(a6), fold(a7)), sc);
    const __m256 x1 = _mm256_mul_ps(hsum8(fold(b0), fold(b1), fold(b2), fold(b3), fold(b4), fold(b5), fold(b6), fold(b7)), sc);
    if (n == 8) {
        _mm256_storeu_ps(s0, x0);
        _mm256_storeu_ps(s1, x1);
    } else {
        float t0[8], t1[8];
        _mm256_storeu_ps(t0, x0);
        _mm256_storeu_ps(t1, x1);
        for (int64_t i = 0; i < n; i++) {
            s0[i] = t0[i];
            s1[i] = t1[i];
        }
    }
}

/* o0 += sum_i w0[i] v_i, o1 += sum_i w1[i] v_i over the same n rows v_i = v + i * vst
 * (d a multiple of 16), each row loaded once for both, 64 values at a time; with each line
 * loaded, the line at the same offset from `pf` is asked for (pf NULL: none). */
static inline __attribute__((always_inline)) void axpy_rows_pair(float *o0, float *o1, const kv_t *v, int64_t vst,
                                                                 const float *w0, const float *w1, int64_t n,
                                                                 const int64_t d, const kv_t *pf) {
    for (int64_t c = 0; c < d; c += 64) {
        const int64_t nv = d - c < 64 ? (d - c) / 16 : 4;
        __m512 x[4], y[4];
        for (int64_t u = 0; u < nv; u++) {
            x[u] = _mm512_loadu_ps(o0 + c + 16 * u);
            y[u] = _mm512_loadu_ps(o1 + c + 16 * u);
        }
        for (int64_t i = 0; i < n; i++) {
            const __m512 u0 = _mm512_set1_ps(w0[i]), u1 = _mm512_set1_ps(w1[i]);
            const kv_t *vi = v + i * vst + c;
            if (pf)
                for (int64_t u = 0; u < nv; u++) prefetch_line(pf + i * vst + c + 16 * u);
            for (int64_t u = 0; u < nv; u++) {
                const __m512 vv = KV_LOAD16(vi + 16 * u);
                x[u] = _mm512_fmadd_ps(u0, vv, x[u]);
                y[u] = _mm512_fmadd_ps(u1, vv, y[u]);
            }
        }
        for (int64_t u = 0; u < nv; u++) {
            _mm512_storeu_ps(o0 + c + 16 * u, x[u]);
            _mm512_storeu_ps(o1 + c + 16 * u, y[u]);
        }
    }
}
#endif

/* One item. Inlined into a copy per common head dim D (constant there, so the row loops
 * unroll and a query row or an output accumulator lives in registers) and a generic copy. */
static inline __attribute__((always_inline)) void attend_item_d(const problem_t *p, int64_t item, float *scores,
                                                                const int64_t d) {
    const int64_t group = p->hq / p->hkv;
    const int64_t hpi = p->hkv / p->splits; /* kv heads per item */
    const int64_t b = item / p->splits, h0 = (item % p->splits) * hpi, nq = hpi * group;
    const int64_t len = p->lens[b];
    const float *q = p->q + (b * p->hq + h0 * group) * d; /* [nq, D]; row r uses kv head h0 + r / group */
    float *out = p->out + (b * p->hq + h0 * group) * d;    /* [nq, D] */
    memset(out, 0, (size_t)(nq * d) * sizeof(float));
    if (len <= 0) return;
    const int32_t *table = p->tables + b * p->max_blocks;
    const int64_t nblk = (len + p->block_size - 1) / p->block_size;
#ifdef PD_AVX2
    const int vec = d % 8 == 0;
#else
    const int vec = 0;
#endif
#ifdef PD_AVX512
    const int pairs = d % 16 == 0 && group > 1; /* query rows two at a time on their shared keys */
    const int spread = pairs;                   /* and they ask for the lines ahead themselves */
#else
    const int spread = 0;
#endif

    /* bytes from an item's first row of a block to past its last */
    const int64_t k_span = (int64_t)sizeof(kv_t) * ((hpi - 1) * p->k_sh + (p->block_size - 1) * p->k_st + d);
    const int64_t v_span = (int64_t)sizeof(kv_t) * ((hpi - 1) * p->v_sh + (p->block_size - 1) * p->v_st + d);
    for (int64_t blk = 0; blk < PREFETCH_AHEAD && blk < nblk; blk++) prefetch_span(p->k + table[blk] * p->k_sb + h0 * p->k_sh, k_span);
    /* pass 1: scores[r][t] = scale * <q_r, k_t>, a block at a time */
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t t0 = blk * p->block_size, n = len - t0 < p->block_size ? len - t0 : p->block_size;
        const kv_t *kb = p->k + table[blk] * p->k_sb + h0 * p->k_sh;
        /* the block PREFETCH_AHEAD on; past the last, V's first blocks, where pass 2 starts */
        const int64_t ahead = blk + PREFETCH_AHEAD;
        const kv_t *kf = ahead < nblk ? p->k + table[ahead] * p->k_sb + h0 * p->k_sh
                                       : p->v + table[ahead - nblk < nblk ? ahead - nblk : 0] * p->v_sb + h0 * p->v_sh;
        if (PREFETCH_AHEAD && !spread && ahead < nblk) prefetch_span(kf, k_span);
        for (int64_t r = 0; r < nq; r++) {
            const kv_t *kh = kb + (r / group) * p->k_sh;
            const float *qr = q + r * d;
            float *s = scores + r * len + t0;
#ifdef PD_AVX512
            if (pairs && r % group + 1 < group) { /* this query row and the next share their keys */
                for (int64_t i = 0; i < n; i += 8)
                    dots8_pair(qr, qr + d, kh + i * p->k_st, p->k_st, n - i < 8 ? n - i : 8, p->scale, s + i, s + len + i, d,
                               kf + (r / group) * p->k_sh + i * p->k_st);
                r++;
                continue;
            }
#endif
#ifdef PD_AVX2
            if (vec) {
                for (int64_t i = 0; i < n; i += 8) dots8(qr, kh + i * p->k_st, p->k_st, n - i < 8 ? n - i : 8, p->scale, s + i, d);
                continue;
            }
#endif
            for (int64_t i = 0; i < n; i++) {
                const kv_t *kt = kh + i * p->k_st;
                float acc = 0.0f;
                for (int64_t j = 0; j < d; j++) acc += qr[j] * kv_f32(kt[j]);
                s[i] = acc * p->scale;
            }
        }
    }
    for (int64_t blk = 0; !spread && blk < PREFETCH_AHEAD && blk < nblk; blk++) prefetch_span(p->v + table[blk] * p->v_sb + h0 * p->v_sh, v_span);
    /* softmax per query row, normalised in place */
    for (int64_t r = 0; r < nq; r++) {
        float *s = scores + r * len, m = s[0], sum = 0.0f;
        for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd simdlen(8) reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    /* pass 2: out[r] = sum_t p[r][t] * v_t, accumulated over a block before one store */
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t t0 = blk * p->block_size, n = len - t0 < p->block_size ? len - t0 : p->block_size;
        const kv_t *vb = p->v + table[blk] * p->v_sb + h0 * p->v_sh;
        const int64_t ahead = blk + PREFETCH_AHEAD;
        const kv_t *vf = ahead < nblk ? p->v + table[ahead] * p->v_sb + h0 * p->v_sh : NULL;
        if (PREFETCH_AHEAD && !spread && vf) prefetch_span(vf, v_span);
        for (int64_t r = 0; r < nq; r++) {
            const kv_t *vh = vb + (r / group) * p->v_sh;
            const float *w = scores + r * len + t0;
            float *o = out + r * d;
#ifdef PD_AVX512
            if (pairs && r % group + 1 < group) {
                axpy_rows_pair(o, o + d, vh, p->v_st, w, w + len, n, d, vf ? vf + (r / group) * p->v_sh : NULL);
                r++;
                continue;
            }
#endif
#ifdef PD_AVX2
            if (vec) {
                axpy_rows(o, vh, p->v_st, w, n, d);
                continue;
            }
#endif
            for (int64_t i = 0; i < n; i++) {
                const kv_t *vt = vh + i * p->v_st;
                for (int64_t j = 0; j < d; j++) o[j] += w[i] * kv_f32(vt[j]);
            }
        }
    }
}

static void attend_item(const problem_t *p, int64_t item, float *scores) {
    switch (p->d) {
        case 64: attend_item_d(p, item, scores, 64); break;
        case 128: attend_item_d(p, item, scores, 128); break;
        case 32: attend_item_d(p, item, scores, 32); break;
        default: attend_item_d(p, item, scores, p->d);
    }
}

static void *run_job(void *arg) {
    job_t *job = (job_t *)arg;
    const problem_t *p = job->p;
    const int64_t rows = p->hq / p->splits;
    float *scores = (float *)malloc((size_t)(rows * (p->max_len > 0 ? p->max_len : 1)) * sizeof(float));
    if (scores == NULL) {
        job->status = 2;
        return NULL;
    }
    for (int64_t item = job->begin; item < job->end; item++) attend_item(p, item, scores);
    free(scores);
    job->status = 0;
    return NULL;
}

/* Returns 0 on success; 1 bad arguments (shapes, a length past its table, a bad block id); 2 out of memory. */
int PD_DECODE_ATTENTION(const float *q, const kv_t *k, const kv_t *v, const int32_t *tables,
                              const int32_t *lens, float *out, int64_t batch, int64_t hq, int64_t hkv,
                              int64_t d, int64_t block_size, int64_t max_blocks, int64_t num_blocks, int64_t k_sb, int64_t k_st,
                              int64_t k_sh, int64_t v_sb, int64_t v_st, int64_t v_sh, float scale,
                              int num_threads) {
    if (batch < 0 || hkv <= 0 || hq % hkv != 0 || d <= 0 || block_size <= 0)
        return 1;
    problem_t p = {q, k, v, tables, lens, out, hq, hkv, d, block_size, max_blocks,
                   k_sb, k_st, k_sh, v_sb, v_st, v_sh, scale, 0, 1};
    int64_t total = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (lens[b] > max_blocks * block_size) return 1;
        for (int64_t i = 0; i * block_size < lens[b]; i++) /* every block read must exist */
            if (tables[b * max_blocks + i] < 0 || tables[b * max_blocks + i] >= num_blocks) return 1;
        if (lens[b] > p.max_len) p.max_len = lens[b];
        total += lens[b] > 0 ? lens[b] : 0;
    }
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    /* Too little work to pay for a thread: under 128 (token, kv head) pairs. A decode
       step's attention reads its K/V from memory (the weights streamed through the caches
       since the last step), at one core's latency-bound pace, so even one sequence of ~64
       tokens and 3 kv heads goes faster on two threads (two heads and one): SmolLM2's
       attention part 352 -> 266 us a step against a threshold of 4096 (decode step A/B,
       int4, 2 threads) */
    if (total * hkv < 128) num_threads = 1;
    /* an item is a whole sequence (all its kv heads, contiguous in each block), unless
       there are too few sequences to keep the threads busy: then one kv head each */
    if (batch < 4 * num_threads) p.splits = hkv;
    const int64_t items = batch * p.splits;
    if (num_threads > items) num_threads = items > 0 ? (int)items : 1;

    /* contiguous runs of items with about equal context (cost ~ context length) */
    job_t jobs[MAX_THREADS];
    int64_t item = 0, done = 0;
    for (int t = 0; t < num_threads; t++) {
        jobs[t].p = &p;
        jobs[t].begin = item;
        jobs[t].status = 0;
        const int64_t goal = (total * p.splits) * (t + 1) / num_threads;
        while (item < items && (done < goal || t == num_threads - 1)) {
            const int32_t len = lens[item / p.splits];
            done += len > 0 ? len : 0;
            item++;
        }
        jobs[t].end = item;
    }
    /* OpenMP: inside a torch process this is torch's own libgomp and thread pool (same
       soname), so no second pool spins against torch's between calls */
    if (num_threads == 1) /* no region: ~0.4 us even on one thread */
        run_job(&jobs[0]);
    else {
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
        for (int t = 0; t < num_threads; t++) run_job(&jobs[t]);
    }
    for (int t = 0; t < num_threads; t++)
        if (jobs[t].status) return jobs[t].status;
    return 0;
}
