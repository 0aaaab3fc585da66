/* Causal prefill attention on CPU over the paged cache, float32: the prompt chunks of a
 * step attend to their sequence's cached context and to themselves.
 *
 *   q        [N, Hq, D]: token t's head h at q + t * ldq + h * D (a view into the fused
 *            q/k/v projection)
 *   k, v     [num_blocks, block_size, Hkv, D] by element strides (block, token, head); every
 *            query's own K/V is in the cache already
 *   seqs     per sequence: q_start (its first query row in q and out), q_len, ctx_len (its
 *            context including the chunk: query i sits at position ctx_len - q_len + i and
 *            sees keys 0 ..= that position), and its block table row
 *   out      [N, Hq, D] contiguous, written for every query row of every sequence
 * GQA: query head i uses kv head i / (Hq / Hkv).
 *
 * Flash-attention's loop on the CPU: a work item is one sequence's kv head and a block of
 * up to TOKENS query tokens, all the query heads of that kv head as rows of one matrix
 * (R = TOKENS x group rows). Keys come KEYS at a time, packed from the cache into panels
 * of 16 (K transposed, V as is), and two small products run on the GEMM's register tile
 * (kernels/csrc/gemm_tile.h): scores S = Q K^T [R x KEYS], then, after the online
 * softmax's update of each row's max and sum (and the rescaling of its output so far),
 * O += P V, both over two panels at a time where there are two. The products run at the
 * GEMM tile's speed, and the context is read in place from the paged cache, where SDPA
 * needs it gathered into a contiguous copy first.
 * Built by kernels/cpu_native.py with the system C compiler at first use.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_tile.h"

#include "bf16.h"

/* The cache's element type kv_t (bf16.h): float32 here; prefill_attention_bf16_cpu.c
   compiles this file again with PD_KV_BF16 for a bf16 cache, whose keys and values are
   widened (exactly) as they are packed into the float32 panels; the rest is unchanged. */
#ifdef PD_KV_BF16
#define PD_PREFILL_ATTENTION pd_prefill_attention_bf16
#else
#define PD_PREFILL_ATTENTION pd_prefill_attention
#endif

#define TOKENS 48 /* query tokens per work item */
#define KEYS 64   /* keys per step: four panels */

typedef struct {
    const float *q;
    const kv_t *k, *v;
    float *out;
    const int32_t *tables, *q_start, *q_len, *ctx_len;
    int64_t ldq, hq, hkv, d, block_size, max_blocks;
    int64_t k_sb, k_st, k_sh, v_sb, v_st, v_sh;
    float scale;
} problem_t;

typedef struct {
    float *qp;  /* [R, D] a token block's query rows, scaled */
    float *s;   /* [R, KEYS] scores, then probabilities */
    float *o;   /* [R, D] output so far */
    float *m;   /* [R] running max */
    float *l;   /* [R] running sum */
    float *kp;  /* per key step: [KEYS / 16][D][16], keys packed */
    float *vp;  /* per key step: [D / 16][KEYS][16], values packed */
} scratch_t;

/* Keys [j0, j0 + nk) of the sequence's kv head h, packed for the tiles (zeros past nk):
 * kp[panel][dim][key % 16] = K[key][h][dim]; vp[dim / 16][key][dim % 16] = V[key][h][dim]. */
static void pack_keys(const problem_t *p, const int32_t *table, int64_t h, int64_t j0, int64_t nk, float *kp, float *vp) {
    const int64_t d = p->d;
    for (int64_t jj = 0; jj < KEYS; jj++) {
        const int64_t pnl = jj / PD_NR, col = jj % PD_NR;
        if (jj < nk) {
            const int64_t key = j0 + jj, blk = table[key / p->block_size], off = key % p->block_size;
            const kv_t *kr = p->k + blk * p->k_sb + off * p->k_st + h * p->k_sh;
            const kv_t *vr = p->v + blk * p->v_sb + off * p->v_st + h * p->v_sh;
            for (int64_t x = 0; x < d; x++) kp[(pnl * d + x) * PD_NR + col] = kv_f32(kr[x]);
#ifdef PD_KV_BF16
            for (int64_t x = 0; x < d; x++) vp[((x / PD_NR) * KEYS + jj) * PD_NR + x % PD_NR] = kv_f32(vr[x]);
#else
            for (int64_t x = 0; x < d; x += PD_NR) memcpy(vp + ((x / PD_NR) * KEYS + jj) * PD_NR, vr + x, sizeof(float) * PD_NR);
#endif
        } else {
            for (int64_t x = 0; x < d; x++) kp[(pnl * d + x) * PD_NR + col] = 0.0f;
            for (int64_t x = 0; x < d; x += PD_NR) memset(vp + ((x / PD_NR) * KEYS + jj) * PD_NR, 0, sizeof(float) * PD_NR);
        }
    }
}

/* One token block [t0, t0 + nt) of the sequence against its packed keys. Row r is token
 * t0 + r % nt of query head h * group + r / nt. */
static void attend_block(const problem_t *p, scratch_t *w, int64_t seq, int64_t h, int64_t t0, int64_t nt) {
    const int64_t d = p->d, group = p->hq / p->hkv, rows = nt * group;
    const int64_t q_len = p->q_len[seq], first_pos = p->ctx_len[seq] - q_len;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = t0 + r % nt, head = h * group + r / nt;
        const float *src = p->q + (p->q_start[seq] + t) * p->ldq + head * d;
        for (int64_t j = 0; j < d; j++) w->qp[r * d + j] = src[j] * p->scale;
        w->m[r] = -FLT_MAX; /* finite: built with -ffast-math, which assumes no infinities */
        w->l[r] = 0.0f;
    }
    memset(w->o, 0, sizeof(float) * rows * d);
    const int64_t last_key = first_pos + t0 + nt - 1; /* the block's last token sees keys ..= this */
    for (int64_t j0 = 0; j0 <= last_key; j0 += KEYS) {
        const int64_t nk = last_key + 1 - j0 < KEYS ? last_key + 1 - j0 : KEYS;
        const float *kp = w->kp + (j0 / KEYS) * KEYS * d, *vp = w->vp + (j0 / KEYS) * KEYS * d;
        /* S = Q K^T, for the groups of rows of which some sees a key of this step */
        for (int64_t r = 0; r < rows; r += PD_MR) {
            const int64_t n = rows - r < PD_MR ? rows - r : PD_MR;
            int64_t newest = 0; /* the group's latest token */
            for (int64_t i = 0; i < n; i++) newest = (r + i) % nt > newest ? (r + i) % nt : newest;
            if (first_pos + t0 + newest < j0) continue;
            for (int64_t pnl = 0; pnl * PD_NR < nk; pnl += 2) {
                const float *kq = kp + pnl * d * PD_NR;
                float *sr = w->s + r * KEYS + pnl * PD_NR;
                if ((pnl + 1) * PD_NR < nk)
                    pd_gemm_tile2((int)n, d, w->qp + r * d, d, 1, kq, kq + d * PD_NR, sr, KEYS, 0, 0, PD_NR);
                else
                    pd_gemm_tile((int)n, d, w->qp + r * d, d, 1, kq, sr, KEYS, 0, 0, PD_NR);
            }
        }
        /* online softmax: mask past each row's own position, update max and sum, rescale */
        for (int64_t r = 0; r < rows; r++) {
            float *s = w->s + r * KEYS;
            const int64_t visible = first_pos + t0 + r % nt - j0 + 1; /* keys j0 .. j0 + visible - 1 */
            const int64_t n = visible < 0 ? 0 : visible < nk ? visible : nk;
            float mx = w->m[r];
            for (int64_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
            const float corr = w->l[r] > 0.0f ? expf(w->m[r] - mx) : 0.0f; /* nothing summed yet: O is 0 */
            float sum = 0.0f;
#pragma omp simd simdlen(8) reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) {
                s[j] = expf(s[j] - mx);
                sum += s[j];
            }
            for (int64_t j = n; j < KEYS; j++) s[j] = 0.0f;
            w->m[r] = mx;
            w->l[r] = w->l[r] * corr + sum;
            if (corr != 1.0f)
                for (int64_t x = 0; x < d; x++) w->o[r * d + x] *= corr;
        }
        /* O += P V over the step's keys, rounded up to whole panels (P is 0 past nk) */
        const int64_t kc = (nk + PD_NR - 1) / PD_NR * PD_NR;
        for (int64_t r = 0; r < rows; r += PD_MR) {
            const int n = rows - r < PD_MR ? (int)(rows - r) : PD_MR;
            for (int64_t pnl = 0; pnl < d / PD_NR; pnl += 2) {
                const float *vq = vp + pnl * KEYS * PD_NR;
                float *orow = w->o + r * d + pnl * PD_NR;
                if (pnl + 1 < d / PD_NR)
                    pd_gemm_tile2(n, kc, w->s + r * KEYS, KEYS, 1, vq, vq + KEYS * PD_NR, orow, d, 1, 0, PD_NR);
                else
                    pd_gemm_tile(n, kc, w->s + r * KEYS, KEYS, 1, vq, orow, d, 1, 0, PD_NR);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = t0 + r % nt, head = h * group + r / nt;
        float *dst = p->out + ((p->q_start[seq] + t) * p->hq + head) * d;
        const float inv = 1.0f / w->l[r];
        for (int64_t x = 0; x < d; x++) dst[x] = w->o[r * d + x] * inv;
    }
}

/* A work item: one sequence's kv head, every token block of it, its keys packed once. */
static void attend_seq_head(const problem_t *p, scratch_t *w, int64_t seq, int64_t h) {
    const int64_t ctx = p->ctx_len[seq], q_len = p->q_len[seq];
    const int32_t *table = p->tables + seq * p->max_blocks;
    for (int64_t j0 = 0; j0 < ctx; j0 += KEYS)
        pack_keys(p, table, h, j0, ctx - j0 < KEYS ? ctx - j0 : KEYS, w->kp + (j0 / KEYS) * KEYS * p->d,
                  w->vp + (j0 / KEYS) * KEYS * p->d);
    for (int64_t t0 = 0; t0 < q_len; t0 += TOKENS) attend_block(p, w, seq, h, t0, q_len - t0 < TOKENS ? q_len - t0 : TOKENS);
}

/* Returns 0; 1 bad arguments (shapes, a context past its table or the cache, a block id
 * outside the cache); 2 out of memory. */
int PD_PREFILL_ATTENTION(const float *q, int64_t ldq, const kv_t *k, const kv_t *v, const int32_t *tables,
                         int64_t max_blocks, int64_t num_blocks, const int32_t *q_start, const int32_t *q_len,
                         const int32_t *ctx_len, int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d,
                         int64_t block_size, int64_t k_sb, int64_t k_st, int64_t k_sh, int64_t v_sb, int64_t v_st,
                         int64_t v_sh, float scale, float *out, int num_threads) {
    if (num_seqs < 0 || hkv <= 0 || hq % hkv || d <= 0 || d % PD_NR || block_size <= 0 || ldq < hq * d
        || num_threads < 1)
        return 1;
    int64_t max_ctx = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (q_len[s] < 0 || q_len[s] > ctx_len[s] || q_start[s] < 0 || ctx_len[s] > max_blocks * block_size) return 1;
        for (int64_t i = 0; i * block_size < ctx_len[s]; i++)
            if (tables[s * max_blocks + i] < 0 || tables[s * max_blocks + i] >= num_blocks) return 1;
        if (ctx_len[s] > max_ctx) max_ctx = ctx_len[s];
    }
    const int64_t items = num_seqs * hkv;
    if (items == 0) return 0;
    problem_t p = {q, k, v, out, tables, q_start, q_len, ctx_len, ldq, hq, hkv, d, block_size, max_blocks,
                   k_sb, k_st, k_sh, v_sb, v_st, v_sh, scale};
    const int64_t rows = TOKENS * (hq / hkv), keys = (max_ctx + KEYS - 1) / KEYS * KEYS;
    if (num_threads > items) num_threads = (int)items;
    int status = 0;
    /* OpenMP: inside a torch process this is torch's own libgomp and thread pool */
#pragma omp parallel num_threads(num_threads)
    {
        float *buf = malloc(sizeof(float) * (size_t)(rows * (2 * d + KEYS + 2) + 2 * keys * d));
        scratch_t w = {0};
        if (buf) {
            w.qp = buf;
            w.o = w.qp + rows * d;
            w.s = w.o + rows * d;
            w.m = w.s + rows * KEYS;
            w.l = w.m + rows;
            w.kp = w.l + rows;
            w.vp = w.kp + keys * d;
        } else {
            status = 2;
        }
        /* a sequence's work grows with q_len x ctx_len: hand the items out one by one */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++)
            if (buf) attend_seq_head(&p, &w, it / hkv, it % hkv);
        free(buf);
    }
    return status;
}
