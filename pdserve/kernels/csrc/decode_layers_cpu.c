/* A decode step's decoder layers on CPU in one native call: the CPU's counterpart of
 * replaying a captured CUDA graph. float32, with float32, bf16 or int8 / int4 weight panels and a
 * float32 or bf16 KV cache.
 *
 * For a batch of `m` sequences with one new token each (m small: a decode batch), the
 * token's embedding row is looked up, then every layer runs the same steps as
 * common.models.decoder.DecoderLayer, through the same kernels the Python path calls one
 * by one, and the final norm last:
 *     h = embed[id] (widened from bf16 where the table is bf16)
 *     x, residual = add_rms_norm(h, residual, input_norm)     (pd_add_rms_norm)
 *     qkv = x @ qkv_w^T (+ qkv_b)                             (pd_gemm)
 *     q, k: per-head RMSNorm (Qwen3, when given), rotary embedding at the token's
 *           position; k and v stored into the paged cache at the token's slot  (here)
 *     a = paged decode attention(q, cache)                    (pd_paged_decode_attention)
 *     h = a @ o_w^T                                           (pd_gemm)
 *     x, residual = add_rms_norm(h, residual, post_norm)      (pd_add_rms_norm)
 *     h = down(silu(gate) * up)                 (pd_gemm_silu; pd_gemm, pd_silu_mul)
 *     out = add_rms_norm(h, residual, final_norm)             (after the last layer)
 *     logits = out @ head^T (+ head_b); top = argmax per row  (pd_gemm; when asked)
 * Between layers, Python dispatch (a dozen torch ops and ctypes calls, each a few
 * microseconds, plus module calls) costs more than the layer's own work at one
 * sequence; and each op left in Python costs far more than that in a real step, where
 * the weights streamed through the caches have evicted the interpreter's code and data.
 * Here it is one call per step.
 *
 *   ids       [m] int64: the tokens; positions [m] int64: their positions (rotary rows)
 *   out       [m, hidden] out: the final norm's output
 *   logits    [m, head_n] out, or NULL: the lm_head's product (M->head must be set then)
 *   top       [m] int64 out, or NULL: each logits row's first index of its largest value
 *             (the first NaN where a row has one: numpy's and torch's argmax)
 *   slots     [m] int64: cache slot (block * block_size + offset) of each token; < 0 skips the store
 *   tables    [m, max_blocks] int32, lens [m] int32: as pd_paged_decode_attention
 *   parts     [PD_DECODE_PARTS] float64 in/out, or NULL: where the time goes, for
 *             benchmarks/decode_parts.py -- seconds added to each part (the order of
 *             kernels.cpu_decode.PARTS), the call's whole time to parts[PD_PART_TOTAL] and
 *             1 to parts[PD_PART_CALLS]. The laps are back to back, so the parts sum to
 *             the total; a lap is one clock read (~20 ns), ~300 a step, none when NULL.
 * Returns 0, 1 (bad arguments: a token id or position outside its table, a slot or block
 * id outside the cache, a length past its table), or 2 (out of memory). Built by
 * kernels/cpu_native.py with the rest.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bf16.h"
#include "gemm_tile.h"

int pd_gemm_q(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, const float *bias, float *y,
              int64_t ldy, int64_t n, int num_threads);
int pd_add_rms_norm(const float *x, const float *residual, const float *weight, float eps, float *out, float *res_out,
                    int64_t rows, int64_t dim, int64_t ldx, int64_t ldr, int num_threads);
int pd_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t dim, int64_t ld, int num_threads);
int pd_gemm_silu_q(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, float *act,
                   int64_t lda, int64_t inter, int num_threads);
void pd_norm_rope_head(const float *src, const float *norm_w, float eps, const float *cos, const float *sin,
                       float *dst, float *tmp, int64_t d);
int pd_paged_decode_attention(const float *q, const float *k, const float *v, const int32_t *tables,
                              const int32_t *lens, float *out, int64_t batch, int64_t hq, int64_t hkv,
                              int64_t d, int64_t block_size, int64_t max_blocks, int64_t num_blocks, int64_t k_sb,
                              int64_t k_st, int64_t k_sh, int64_t v_sb, int64_t v_st, int64_t v_sh, float scale,
                              int num_threads);
int pd_paged_decode_attention_bf16(const float *q, const uint16_t *k, const uint16_t *v, const int32_t *tables,
                                   const int32_t *lens, float *out, int64_t batch, int64_t hq, int64_t hkv, int64_t d,
                                   int64_t block_size, int64_t max_blocks, int64_t num_blocks, int64_t k_sb,
                                   int64_t k_st, int64_t k_sh, int64_t v_sb, int64_t v_st, int64_t v_sh, float scale,
                                   int num_threads);
void pd_f32_to_bf16_row(const float *src, uint16_t *dst, int64_t n);

/* One layer's weights and cache (kernels.cpu_decode._LayerStruct mirrors this). Weight
 * matrices [out, in] are packed for pd_gemm (kernels/csrc/gemm_cpu.c), each of its own
 * kind (PD_W_*: float32, bf16 widened in registers, or weight-only int8 / int4 by int8
 * dot products at any batch size, pd_gemm_qdot); the rest float32. */
typedef struct {
    const float *input_norm, *post_norm;  /* [hidden] */
    const void *qkv_p;                    /* [(hq + 2 hkv) d, hidden] packed */
    const float *qkv_b;                   /* bias or NULL */
    const float *q_norm, *k_norm;         /* [d] each, or both NULL */
    const void *o_p;                      /* [hidden, hq d] packed */
    const void *gate_up_p;                /* [2 inter, hidden] packed */
    const void *down_p;                   /* [hidden, inter] packed */
    void *k_cache, *v_cache;              /* [num_blocks, block_size, hkv, d] by element strides */
    int64_t k_sb, k_st, k_sh, v_sb, v_st, v_sh;
    int64_t qkv_kind, o_kind, gate_up_kind, down_kind; /* PD_W_* of gemm_tile.h */
    int64_t kv_bf16;                      /* 0: float32 cache, 1: bf16 cache (stored rounded to nearest even) */
} pd_layer_t;

/* What the layers take from the model around them (kernels.cpu_decode._ModelStruct
 * mirrors this) */
typedef struct {
    const void *embed;            /* [vocab, hidden]: float32, or bf16 (embed_bf16) */
    int64_t vocab, embed_bf16;
    const float *cos, *sin;       /* [max_positions, d]: rotary rows, sin's first half negated */
    int64_t max_positions;
    const float *final_norm;      /* [hidden] */
    const void *head;             /* the lm_head [head_n, hidden] packed as a layer's matrices, or NULL */
    const float *head_b;          /* its bias [head_n] or NULL */
    int64_t head_n, head_kind;    /* PD_W_* */
} pd_model_t;

/* pd_paged_decode_attention on a layer's cache of either dtype */
static int attention_w(const pd_layer_t *L, const float *q, const int32_t *tables, const int32_t *lens, float *out,
                       int64_t m, int64_t hq, int64_t hkv, int64_t d, int64_t block_size, int64_t max_blocks,
                       int64_t num_blocks, float scale, int num_threads) {
    if (L->kv_bf16)
        return pd_paged_decode_attention_bf16(q, L->k_cache, L->v_cache, tables, lens, out, m, hq, hkv, d, block_size,
                                              max_blocks, num_blocks, L->k_sb, L->k_st, L->k_sh, L->v_sb, L->v_st,
                                              L->v_sh, scale, num_threads);
    return pd_paged_decode_attention(q, L->k_cache, L->v_cache, tables, lens, out, m, hq, hkv, d, block_size,
                                     max_blocks, num_blocks, L->k_sb, L->k_st, L->k_sh, L->v_sb, L->v_st, L->v_sh,
                                     scale, num_threads);
}

/* pd_gemm on panels of a kind (PD_W_*): a quantized weight by int8 dot products at any m
   (every row here is a decode token; kernels.decode_rows is the Python side's same choice) */
static int gemm_w(int64_t kind, const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, const float *bias,
                  float *y, int64_t ldy, int64_t n, int num_threads) {
    if (pd_quant_block_bytes((int)kind) > 0) return pd_gemm_qdot(x, ldx, m, k, p, (int)kind, bias, y, ldy, n, num_threads);
    return pd_gemm_q(x, ldx, m, k, p, (int)kind, bias, y, ldy, n, num_threads);
}

/* h [m, hidden] = the tokens' embedding rows, float32 */
static void embed_rows(const pd_model_t *M, const int64_t *ids, int64_t m, int64_t hidden, float *h) {
    for (int64_t r = 0; r < m; r++) {
        float *row = h + r * hidden;
        if (M->embed_bf16) {
            const uint16_t *src = (const uint16_t *)M->embed + ids[r] * hidden;
            for (int64_t j = 0; j < hidden; j++) row[j] = pd_bf16_to_f32(src[j]);
        } else {
            const float *src = (const float *)M->embed + ids[r] * hidden;
            for (int64_t j = 0; j < hidden; j++) row[j] = src[j];
        }
    }
}

/* One decode row's q heads normed and rotated into q_row [hq, d], and its k (normed,
 * rotated) and v heads stored at its cache slot (skipped when the slot is < 0) */
static void rope_store_row(const pd_layer_t *L, const pd_model_t *M, const float *row, int64_t pos, int64_t slot,
                           float *q_row, int64_t hq, int64_t hkv, int64_t d, int64_t block_size, float qk_eps) {
    float tmp[d], kr[d]; /* one head vector each */
    const float *c = M->cos + pos * d, *s = M->sin + pos * d;
    for (int64_t i = 0; i < hq; i++) pd_norm_rope_head(row + i * d, L->q_norm, qk_eps, c, s, q_row + i * d, tmp, d);
    if (slot < 0) return;
    const int64_t blk = slot / block_size, off = slot % block_size;
    for (int64_t i = 0; i < hkv; i++) {
        const int64_t ko = blk * L->k_sb + off * L->k_st + i * L->k_sh;
        const int64_t vo = blk * L->v_sb + off * L->v_st + i * L->v_sh;
        const float *vs = row + (hq + hkv + i) * d;
        if (L->kv_bf16) {
            pd_norm_rope_head(row + (hq + i) * d, L->k_norm, qk_eps, c, s, kr, tmp, d);
            pd_f32_to_bf16_row(kr, (uint16_t *)L->k_cache + ko, d);
            pd_f32_to_bf16_row(vs, (uint16_t *)L->v_cache + vo, d);
        } else {
            float *vd = (float *)L->v_cache + vo;
            pd_norm_rope_head(row + (hq + i) * d, L->k_norm, qk_eps, c, s, (float *)L->k_cache + ko, tmp, d);
            for (int64_t j = 0; j < d; j++) vd[j] = vs[j];
        }
    }
}

/* The parts of a step `parts` times, in kernels.cpu_decode.PARTS's order */
enum {
    PD_PART_EMBED, PD_PART_NORMS, PD_PART_QKV, PD_PART_ROPE_STORE, PD_PART_ATTENTION, PD_PART_O, PD_PART_GATE_UP,
    PD_PART_DOWN, PD_PART_LM_HEAD, PD_PART_ARGMAX, PD_PART_TOTAL, PD_PART_CALLS, PD_DECODE_PARTS
};

static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* parts[part] += the time since *t, and *t = now (nothing when parts is NULL) */
static inline void lap(double *parts, int part, double *t) {
    if (!parts) return;
    const double now = now_s();
    parts[part] += now - *t;
    *t = now;
}

/* Whether v is a NaN, by its bits: -ffast-math (the build's) lets isnan() fold to 0 */
static inline int nan_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return (u & 0x7fffffffu) > 0x7f800000u;
}

/* top[r] = the first index of row r's largest value (of its first NaN, if any). Two
 * passes, the first a vectorizable max and NaN test over the row (~10x a scalar argmax
 * loop at a 49k vocabulary), the second a scan to its first occurrence. */
static void argmax_rows(const float *logits, int64_t m, int64_t n, int64_t *top) {
    for (int64_t r = 0; r < m; r++) {
        const float *row = logits + r * n;
        uint32_t nan = 0;
        float mx = row[0];
        for (int64_t j = 0; j < n; j++) {
            uint32_t u;
            memcpy(&u, row + j, sizeof u);
            nan |= (u & 0x7fffffffu) > 0x7f800000u;
            mx = row[j] > mx ? row[j] : mx;
        }
        int64_t best = 0;
        if (nan)
            while (!nan_bits(row[best])) best++;
        else
            while (row[best] != mx) best++;
        top[r] = best;
    }
}

int pd_decode_layers(const pd_layer_t *layers, int64_t num_layers, int64_t m, int64_t hidden, int64_t hq,
                     int64_t hkv, int64_t d, int64_t inter, int64_t block_size, int64_t num_blocks, float norm_eps,
                     float qk_eps, float scale, const pd_model_t *M, const int64_t *ids, const int64_t *positions,
                     float *out, const int64_t *slots, const int32_t *tables, const int32_t *lens, int64_t max_blocks,
                     int num_threads, float *logits, int64_t *top, double *parts) {
    if ((logits || top) && (!M->head || M->head_n <= 0 || !logits))
        return 1;
    if (m <= 0 || num_layers < 0 || hidden <= 0 || hkv <= 0 || hq % hkv != 0 || d <= 0 || d % 2 || d > 4096 || inter <= 0
        || block_size <= 0 || num_threads < 1)
        return 1;
    for (int64_t r = 0; r < m; r++)
        if (slots[r] >= num_blocks * block_size || ids[r] < 0 || ids[r] >= M->vocab || positions[r] < 0
            || positions[r] >= M->max_positions)
            return 1;
    const int64_t nqkv = (hq + 2 * hkv) * d;
    /* scratch: h and residual [m, hidden] (the stream), x [m, hidden], qkv [m, nqkv],
       q [m, hq d], attention out [m, hq d], gate_up [m, 2 inter], act [m, inter] */
    const int64_t need = m * (3 * hidden + nqkv + 2 * hq * d + 3 * inter);
    float *buf = malloc((size_t)need * sizeof(float));
    if (!buf) return 2;
    float *h = buf, *residual = h + m * hidden, *x = residual + m * hidden, *qkv = x + m * hidden;
    float *q = qkv + m * nqkv, *att = q + m * hq * d, *gu = att + m * hq * d;
    float *act = gu + m * 2 * inter;
    const double t0 = parts ? now_s() : 0.0;
    double t = t0;
    embed_rows(M, ids, m, hidden, h);
    lap(parts, PD_PART_EMBED, &t);
    int status = 0;
    for (int64_t l = 0; l < num_layers && !status; l++) {
        const pd_layer_t *L = &layers[l];
        /* the first layer starts the stream: residual = h */
        status = pd_add_rms_norm(h, l ? residual : NULL, L->input_norm, norm_eps, x, residual, m, hidden, hidden, hidden,
                                 num_threads);
        lap(parts, PD_PART_NORMS, &t);
        if (!status)
            status = gemm_w(L->qkv_kind, x, hidden, m, hidden, L->qkv_p, L->qkv_b, qkv, nqkv, nqkv, num_threads);
        lap(parts, PD_PART_QKV, &t);
        if (status) break;
        /* rows apart: each writes its own q rows and cache slot; a parallel region costs
           ~0.4 us even on one thread, so a small batch calls the rows directly */
        if (m >= 8 && num_threads > 1) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
            for (int64_t r = 0; r < m; r++) rope_store_row(L, M, qkv + r * nqkv, positions[r], slots[r], q + r * hq * d, hq, hkv, d, block_size, qk_eps);
        } else {
            for (int64_t r = 0; r < m; r++) rope_store_row(L, M, qkv + r * nqkv, positions[r], slots[r], q + r * hq * d, hq, hkv, d, block_size, qk_eps);
        }
        lap(parts, PD_PART_ROPE_STORE, &t);
        status = attention_w(L, q, tables, lens, att, m, hq, hkv, d, block_size, max_blocks, num_blocks, scale,
                             num_threads);
        lap(parts, PD_PART_ATTENTION, &t);
        if (!status)
            status = gemm_w(L->o_kind, att, hq * d, m, hq * d, L->o_p, NULL, h, hidden, hidden, num_threads);
        lap(parts, PD_PART_O, &t);
        if (!status)
            status = pd_add_rms_norm(h, residual, L->post_norm, norm_eps, x, residual, m, hidden, hidden, hidden,
                                     num_threads);
        lap(parts, PD_PART_NORMS, &t);
        if (!status && inter % PD_NR == 0) /* whole panels: gate and up in one pass */
            status = (pd_quant_block_bytes((int)L->gate_up_kind) > 0 ? pd_gemm_silu_qdot : pd_gemm_silu_q)(
                x, hidden, m, hidden, L->gate_up_p, (int)L->gate_up_kind, act, inter, inter, num_threads);
        else if (!status) {
            status = gemm_w(L->gate_up_kind, x, hidden, m, hidden, L->gate_up_p, NULL, gu, 2 * inter, 2 * inter,
                            num_threads);
            if (!status) status = pd_silu_mul(gu, act, m, inter, 2 * inter, num_threads);
        }
        lap(parts, PD_PART_GATE_UP, &t);
        if (!status)
            status = gemm_w(L->down_kind, act, inter, m, inter, L->down_p, NULL, h, hidden, hidden, num_threads);
        lap(parts, PD_PART_DOWN, &t);
    }
    if (!status) /* no layers: the embeddings are the stream */
        status = pd_add_rms_norm(h, num_layers ? residual : NULL, M->final_norm, norm_eps, out, residual, m, hidden,
                                 hidden, hidden, num_threads);
    lap(parts, PD_PART_NORMS, &t);
    if (!status && logits)
        status = gemm_w(M->head_kind, out, hidden, m, hidden, M->head, M->head_b, logits, M->head_n, M->head_n,
                        num_threads);
    lap(parts, PD_PART_LM_HEAD, &t);
    if (!status && top) argmax_rows(logits, m, M->head_n, top);
    free(buf);
    lap(parts, PD_PART_ARGMAX, &t);
    if (parts) {
        parts[PD_PART_TOTAL] += t - t0;
        parts[PD_PART_CALLS] += 1.0;
    }
    return status;
}
