/* The decoder layer's elementwise steps on CPU, fused: each is one pass over its rows
 * where torch runs four to six ops (and as many dispatches) for it. float32 only.
 *
 * pd_add_rms_norm: for each of `rows` rows of `dim` values,
 *     res_out = x + residual            (skipped when residual is NULL: res_out = x)
 *     out     = res_out * rsqrt(mean(res_out^2) + eps) * weight
 *   as transformers computes it (the residual stream's add, then RMSNorm in float32).
 * pd_silu_mul: out[r, i] = silu(gate_up[r, i]) * gate_up[r, dim + i]  (SwiGLU's gate).
 * pd_store_kv: each token's K and V head vectors copied into its cache slot (block, offset)
 *   of the paged caches, given by element strides (the CPU cache is head-major in a block:
 *   common.kv_layout); slots < 0 are skipped, and nothing is written when one is past
 *   the cache.
 * pd_qk_norm_rope: in place on the fused q/k/v projection's rows, each q and k head vector
 *   RMS-normed (Qwen3's q_norm / k_norm, when given) and rotated by its token's rotary
 *   row: x * cos + roll(x, D/2) * sin_signed, sin's first half stored negated
 *   (common.models.layers.RotaryEmbedding), multiplied and added apart as torch does.
 *
 * Row pointers step by the given leading dimensions; `out` and `res_out` are written
 * contiguously. Rows are split between `num_threads` OpenMP threads when there are
 * enough of them to pay for waking the threads (torch's own libgomp pool).
 * Built by kernels/cpu_native.py with the system C compiler at first use.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_MIN_ELEMS 32768 /* below this one thread is faster than waking two */

static void add_rms_norm_row(const float *x, const float *residual, const float *weight, float eps, float *out,
                             float *res_out, int64_t dim) {
    float ss = 0.0f;
    if (residual) {
        for (int64_t i = 0; i < dim; i++) {
            const float h = x[i] + residual[i];
            res_out[i] = h;
            ss += h * h;
        }
    } else {
        for (int64_t i = 0; i < dim; i++) {
            res_out[i] = x[i];
            ss += x[i] * x[i];
        }
    }
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) out[i] = weight[i] * (res_out[i] * inv);
}

int pd_add_rms_norm(const float *x, const float *residual, const float *weight, float eps, float *out, float *res_out,
                    int64_t rows, int64_t dim, int64_t ldx, int64_t ldr, int num_threads) {
    if (rows < 0 || dim <= 0 || ldx < dim || (residual && ldr < dim) || num_threads < 1) return 1;
    if (rows * dim < PARALLEL_MIN_ELEMS || num_threads == 1) { /* no region: ~0.4 us even on one thread */
        for (int64_t r = 0; r < rows; r++)
            add_rms_norm_row(x + r * ldx, residual ? residual + r * ldr : 0, weight, eps, out + r * dim,
                             res_out + r * dim, dim);
        return 0;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(x + r * ldx, residual ? residual + r * ldr : 0, weight, eps, out + r * dim, res_out + r * dim,
                         dim);
    return 0;
}

/* One head vector of d values, normed (norm_w given) and rotated, from src into dst (which
 * may be src); tmp holds d values. The products and the sum are rounded apart, as torch's
 * separate ops round them (no fused multiply-add). */
__attribute__((optimize("fp-contract=off"))) void pd_norm_rope_head(const float *src, const float *norm_w, float eps,
                                                                    const float *cos, const float *sin, float *dst,
                                                                    float *tmp, int64_t d) {
    const int64_t half = d / 2;
    if (norm_w) {
        float ss = 0.0f;
        for (int64_t i = 0; i < d; i++) ss += src[i] * src[i];
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        for (int64_t i = 0; i < d; i++) tmp[i] = (src[i] * inv) * norm_w[i];
    } else {
        for (int64_t i = 0; i < d; i++) tmp[i] = src[i];
    }
    for (int64_t i = 0; i < d; i++) {
        const float a = tmp[i] * cos[i], b = (i < half ? tmp[i + half] : tmp[i - half]) * sin[i];
        dst[i] = a + b;
    }
}

int pd_qk_norm_rope(float *qkv, int64_t rows, int64_t ld, int64_t hq, int64_t hkv, int64_t d, const float *q_norm,
                    const float *k_norm, float eps, const float *cos, const float *sin, int num_threads) {
    if (rows < 0 || hq < 0 || hkv < 0 || d <= 0 || d % 2 || d > 4096 || ld < (hq + hkv) * d || num_threads < 1
        || (!q_norm) != (!k_norm))
        return 1;
    if (rows * (hq + hkv) * d < PARALLEL_MIN_ELEMS) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float tmp[4096];
        float *row = qkv + r * ld;
        for (int64_t h = 0; h < hq + hkv; h++)
            pd_norm_rope_head(row + h * d, h < hq ? q_norm : k_norm, eps, cos + r * d, sin + r * d, row + h * d, tmp, d);
    }
    return 0;
}

/* o[i] = silu(g[i]) * u[i] for i < n: one row of pd_silu_mul, and the epilogue of the
 * fused gate/up product (pd_gemm_silu, kernels/csrc/gemm_cpu.c), so both give the same bits */
void pd_silu_mul_row(const float *g, const float *u, float *o, int64_t n) {
    /* exp's argument capped at 88 (exp(88) < FLT_MAX): past ~88.7 it is inf, and the
       division -ffast-math makes (a reciprocal refined by Newton's step, inf * 0) turns
       silu(g <= -89) into NaN instead of -0; the cap leaves it ~g * 6e-39, torch's ~0 */
#pragma omp simd simdlen(8)
    for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(fminf(-g[i], 88.0f))) * u[i];
}

int pd_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t dim, int64_t ld, int num_threads) {
    if (rows < 0 || dim <= 0 || ld < 2 * dim || num_threads < 1) return 1;
    if (rows * dim < PARALLEL_MIN_ELEMS) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) pd_silu_mul_row(gate_up + r * ld, gate_up + r * ld + dim, out + r * dim, dim);
    return 0;
}

/* dst[i] = src[i] rounded to bf16, to nearest even (NaN: 0x7fc0), bit for bit torch's
 * float -> bfloat16 conversion; integer arithmetic on the bits, so -ffast-math cannot
 * change it. For the bf16 KV cache (pd_store_kv_bf16, and the decode stack's store). */
void pd_f32_to_bf16_row(const float *src, uint16_t *dst, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + i, sizeof u);
        const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        dst[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
    }
}

/* float32 caches (bf16 == 0): copied; bf16 caches: rounded to nearest even */
static int store_kv(const float *key, int64_t k_rs, int64_t k_hs, const float *value, int64_t v_rs, int64_t v_hs,
                    void *k_cache, int64_t kc_sb, int64_t kc_st, int64_t kc_sh, void *v_cache, int64_t vc_sb,
                    int64_t vc_st, int64_t vc_sh, const int64_t *slots, int64_t n, int64_t hkv, int64_t d,
                    int64_t block_size, int64_t num_blocks, int num_threads, int bf16) {
    if (n < 0 || hkv <= 0 || d <= 0 || block_size <= 0 || num_threads < 1) return 1;
    for (int64_t r = 0; r < n; r++)
        if (slots[r] >= num_blocks * block_size) return 1;
    if (n * hkv * d < PARALLEL_MIN_ELEMS) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        if (slots[r] < 0) continue;
        const int64_t blk = slots[r] / block_size, off = slots[r] % block_size;
        for (int64_t h = 0; h < hkv; h++) {
            const float *ks = key + r * k_rs + h * k_hs, *vs = value + r * v_rs + h * v_hs;
            const int64_t ko = blk * kc_sb + off * kc_st + h * kc_sh, vo = blk * vc_sb + off * vc_st + h * vc_sh;
            if (bf16) {
                pd_f32_to_bf16_row(ks, (uint16_t *)k_cache + ko, d);
                pd_f32_to_bf16_row(vs, (uint16_t *)v_cache + vo, d);
            } else {
                memcpy((float *)k_cache + ko, ks, sizeof(float) * d);
                memcpy((float *)v_cache + vo, vs, sizeof(float) * d);
            }
        }
    }
    return 0;
}

int pd_store_kv(const float *key, int64_t k_rs, int64_t k_hs, const float *value, int64_t v_rs, int64_t v_hs,
                float *k_cache, int64_t kc_sb, int64_t kc_st, int64_t kc_sh, float *v_cache, int64_t vc_sb,
                int64_t vc_st, int64_t vc_sh, const int64_t *slots, int64_t n, int64_t hkv, int64_t d,
                int64_t block_size, int64_t num_blocks, int num_threads) {
    return store_kv(key, k_rs, k_hs, value, v_rs, v_hs, k_cache, kc_sb, kc_st, kc_sh, v_cache, vc_sb, vc_st, vc_sh,
                    slots, n, hkv, d, block_size, num_blocks, num_threads, 0);
}

/* pd_store_kv into bf16 caches (element strides), each value rounded to nearest even */
int pd_store_kv_bf16(const float *key, int64_t k_rs, int64_t k_hs, const float *value, int64_t v_rs, int64_t v_hs,
                     uint16_t *k_cache, int64_t kc_sb, int64_t kc_st, int64_t kc_sh, uint16_t *v_cache, int64_t vc_sb,
                     int64_t vc_st, int64_t vc_sh, const int64_t *slots, int64_t n, int64_t hkv, int64_t d,
                     int64_t block_size, int64_t num_blocks, int num_threads) {
    return store_kv(key, k_rs, k_hs, value, v_rs, v_hs, k_cache, kc_sb, kc_st, kc_sh, v_cache, vc_sb, vc_st, vc_sh,
                    slots, n, hkv, d, block_size, num_blocks, num_threads, 1);
}
