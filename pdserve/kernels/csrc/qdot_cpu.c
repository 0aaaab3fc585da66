/* A quantized weight's product with a decode batch by int8 dot products, llama.cpp's way
 * (pd_gemm_q's choice up to PD_QDOT_ROWS rows of x; the panel layout is drawn in
 * gemm_quant_cpu.c's header): each row of x quantized per 32 values to int8 with one
 * float scale (llama.cpp's q8_0 / q8_1 activations), integer dot products per group, a
 * few float steps per group and column.
 *
 * Arithmetic, per row of x, group g and column: x's group quantized as
 * dx = max |x| * (1 / 127), qx = round-to-nearest-even(x * (127 / max |x|)), sx = sum qx;
 * isum = sum q qx over the group (exact, in int32); then
 *     Q8:  acc = fma(d dx, isum, acc)          Q4: acc = fma(d dx, isum - 8 sx, acc)
 *     Q4M: acc = acc + fma(m, dx sx, (d dx) isum)
 * each product, multiply-add and sum rounded to float32 once, groups in order of k. Q4M's
 * group term is complete before it meets acc, so that the chain from group to group is
 * one add (the other steps of successive groups overlap). The plain C build (no AVX2)
 * computes the same integers and the same float steps.
 *
 * A decode step streams every weight once and does little arithmetic per byte, so the
 * code is shaped for the memory stream: a pass over a panel runs up to 4 rows of x (each
 * weight load serves them all), and on AVX2 each group's lines are prefetched
 * PD_QPREFETCH bytes ahead, across panel (and matrix) ends, so that the prefetcher is not
 * left to find the stream again at each 4 KB page. A decode step of up to 4 rows takes
 * two panels per pass, each from a sequential stream of its own: a thread's first and
 * second halves of panels side by side, or SwiGLU's gate panel beside its up panel (two
 * panels from one stream, j beside j + 1, were ~20% slower than one at a time) -- one row
 * interleaved quad by quad (qdot_pair1: it has no other rows' work to overlap with a
 * line's arrival), more a group of each panel in turn (qdot_two). On one Zen 3 core, the
 * builds alternated in one process: SmolLM2's products at one row take 1/1.18 (int4) and
 * 1/1.12 (int8) of the time one panel per pass took (benchmarks/decode_parts.py); its
 * layers' matrices at 2 / 3 / 4 rows 1/1.10, 1/1.07, 1/1.07 (int4) and 1/1.00, 1/1.17,
 * 1/1.09 (int8).
 *
 * VNNI. qdot_avxvnni_cpu.c and qdot_avx512vnni_cpu.c compile this file again with
 * PD_QDOT_DPBUSD set, under a target pragma (gcc 11 or later): each quad's integer sums by
 * one vpdpbusd (u8 x s8, four products summed into each int32 lane) where the code here
 * takes maddubs (u8 x s8, pairs summed into int16 lanes) and madd (int16 pairs into int32).
 * The same integers, so the same bits after the same float steps: every product and sum
 * is exact on both paths. Q8: maddubs(|w|, sign(x, w)) has |w| <= 128 and |x| <= 127 (a
 * group's codes are round(x 127 / max |x|)), so a pair is at most 32512 < 2^15 (no
 * saturation), and madd's and vpdpbusd's int32 sums of a group's 32 products stay under
 * 32 128 127 < 2^31. Q4: codes 0..15, pairs at most 3810, eight quads' int16 sums at most
 * 30480 < 2^15 (below); vpdpbusd sums the same four bytes of each int32 lane in int32 at
 * once, and group_into skips the madd that widens the int16 sums. pd_gemm_qdot and
 * pd_gemm_silu_qdot (in the plain compile of this file) run the variant
 * pd_qdot_set_variant chose (kernels/cpu_native.py: where the CPU reports the feature and
 * the OS enables its state, as __builtin_cpu_supports checks). x is quantized by the one
 * pd_quantize_rows_q8 of the plain compile for every variant. Built with
 * -DPD_QDOT_EMULATE_VNNI, the AVX-VNNI copy takes vpdpbusd's exact sum in AVX2 instructions
 * instead and runs anywhere: the tests run the variants' code on a CPU without VNNI so.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PD_QAVX2 1
#endif

#include "quant_block.h"

/* Which integer dot products this compile makes (the header's VNNI): 0 maddubs (the plain
 * compile), 1 AVX-VNNI, 2 AVX512-VNNI (256-bit, with VL), 3 vpdpbusd emulated in AVX2 */
#ifndef PD_QDOT_DPBUSD
#define PD_QDOT_DPBUSD 0
#endif
#if PD_QDOT_DPBUSD == 1 || PD_QDOT_DPBUSD == 2 || PD_QDOT_DPBUSD == 3
#define QDOT_FN(name) name##_avxvnni
#if PD_QDOT_DPBUSD == 1
#pragma GCC target("avxvnni")
#define PD_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#elif PD_QDOT_DPBUSD == 3
#define PD_DPBUSD(acc, u, s) dpbusd_emulated(acc, u, s)
#endif
#endif
#if PD_QDOT_DPBUSD == 2
#undef QDOT_FN
#define QDOT_FN(name) name##_avx512vnni
#pragma GCC target("avx512vnni,avx512vl")
#define PD_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#endif
#if PD_QDOT_DPBUSD == 0
#define QDOT_FN(name) name##_maddubs
#endif

#define NR PD_NR
#define QG PD_QGROUP
#define ROW_TILE 4              /* rows of x per pass over a panel */
#define QMC 128                 /* rows of x whose codes (at most 128 k bytes) stay in L2 while the panels pass */
#define PARALLEL_MIN_MACS 65536 /* as pd_gemm's: below this one thread */
#ifndef PD_QPREFETCH
#define PD_QPREFETCH 1024 /* bytes ahead of the group being read */
#endif
#ifndef PD_QPREFETCH_HINT
#define PD_QPREFETCH_HINT _MM_HINT_T0
#endif
#define AI inline __attribute__((always_inline))

void pd_silu_mul_row(const float *g, const float *u, float *o, int64_t n); /* elementwise_cpu.c */

/* x's rows quantized per group: codes q [m][k], scales d, code sums s and d s [m][k / 32] */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *s;
    float *ds;
} qrows_t;

#if PD_QDOT_DPBUSD == 0
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

/* x [m, k] (rows ldx apart) quantized into q, d, s; exported for the tests */
int pd_quantize_rows_q8(const float *x, int64_t ldx, int64_t m, int64_t k, int8_t *q, float *d, int32_t *s) {
    if (m < 0 || k <= 0 || k % QG || ldx < k) return 1;
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < k / QG; g++)
            quantize_group(x + i * ldx + g * QG, q + i * k + g * QG, d + i * (k / QG) + g, s + i * (k / QG) + g);
    return 0;
}
#else
int pd_quantize_rows_q8(const float *x, int64_t ldx, int64_t m, int64_t k, int8_t *q, float *d, int32_t *s);
#endif

#ifdef PD_QAVX2
#define PIN(v) __asm__("" : "+x"(v))

/* A group's integer sums s0, s1 (columns 0-7, 8-15; int16 pairs for the int4 kinds) into
 * the accumulators a0, a1: the header's float steps, d0 d1 (and m0 m1) the block's scales
 * (and minimums) widened, dx the row's scale, xs its code sum, xds its d s */
static AI void group_into(const int KIND, __m256i s0, __m256i s1, __m256 d0, __m256 d1, __m256 m0, __m256 m1,
                          __m256 dx, int32_t xs, float xds, __m256 *a0, __m256 *a1) {
    if (KIND != PD_W_Q8 && !PD_QDOT_DPBUSD) { /* int16 sums to int32 (vpdpbusd's are int32 already) */
        const __m256i ones = _mm256_set1_epi16(1);
        s0 = _mm256_madd_epi16(s0, ones);
        s1 = _mm256_madd_epi16(s1, ones);
    }
    if (KIND == PD_W_Q4) {
        const __m256i eight_s = _mm256_set1_epi32(8 * xs);
        s0 = _mm256_sub_epi32(s0, eight_s);
        s1 = _mm256_sub_epi32(s1, eight_s);
    }
    if (KIND == PD_W_Q4M) {
        const __m256 mds = _mm256_set1_ps(xds);
        __m256 t0 = _mm256_mul_ps(_mm256_mul_ps(d0, dx), _mm256_cvtepi32_ps(s0));
        __m256 t1 = _mm256_mul_ps(_mm256_mul_ps(d1, dx), _mm256_cvtepi32_ps(s1));
        PIN(t0);
        PIN(t1);
        t0 = _mm256_fmadd_ps(m0, mds, t0);
        t1 = _mm256_fmadd_ps(m1, mds, t1);
        PIN(t0);
        PIN(t1);
        *a0 = _mm256_add_ps(*a0, t0);
        *a1 = _mm256_add_ps(*a1, t1);
    } else {
        *a0 = _mm256_fmadd_ps(_mm256_mul_ps(d0, dx), _mm256_cvtepi32_ps(s0), *a0);
        *a1 = _mm256_fmadd_ps(_mm256_mul_ps(d1, dx), _mm256_cvtepi32_ps(s1), *a1);
    }
}

/* x's four codes at q, broadcast to every 32-bit lane */
static AI __m256i codes4(const int8_t *q) {
    int32_t x4;
    memcpy(&x4, q, 4);
    return _mm256_set1_epi32(x4);
}

/* One quad of a block (its codes at qd) against R rows' four codes each (at xq[i] + at),
   into the group's integer sums is[i][0:2] (columns 0-7, 8-15); the weights' loads (and
   |w|) serve every row, each row's codes broadcast as it comes */
#if PD_QDOT_DPBUSD == 3
/* vpdpbusd's arithmetic in AVX2: acc + the four products u8 x s8 of each 32-bit lane, each
   exact in int16 (|u s| <= 255 128 < 2^15) and madd's pairs exact in int32 */
static AI __m256i dpbusd_emulated(__m256i acc, __m256i u, __m256i s) {
    const __m256i even_u = _mm256_and_si256(u, _mm256_set1_epi16(0xff)), odd_u = _mm256_srli_epi16(u, 8);
    const __m256i even_s = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), odd_s = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(even_u, even_s), _mm256_madd_epi16(odd_u, odd_s)));
}
#endif

static AI void quad_into(const int R, const int KIND, const uint8_t *qd, const int8_t *const xq[], int64_t at,
                         __m256i is[][2]) {
#if PD_QDOT_DPBUSD
    if (KIND == PD_W_Q8) { /* |w| by sign(x, w), as below, summed by vpdpbusd */
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)qd);
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(qd + 32));
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        for (int i = 0; i < R; i++) {
            const __m256i xb = codes4(xq[i] + at);
            is[i][0] = PD_DPBUSD(is[i][0], a0, _mm256_sign_epi8(xb, w0));
            is[i][1] = PD_DPBUSD(is[i][1], a1, _mm256_sign_epi8(xb, w1));
            PIN(is[i][0]);
            PIN(is[i][1]);
        }
    } else { /* codes 0..15 unsigned, int32 sums */
        const __m256i low = _mm256_set1_epi8(0x0f);
        const __m256i v = _mm256_loadu_si256((const __m256i *)qd);
        const __m256i w0 = _mm256_and_si256(v, low), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int i = 0; i < R; i++) {
            const __m256i xb = codes4(xq[i] + at);
            is[i][0] = PD_DPBUSD(is[i][0], w0, xb);
            is[i][1] = PD_DPBUSD(is[i][1], w1, xb);
            PIN(is[i][0]);
            PIN(is[i][1]);
        }
    }
#else
    if (KIND == PD_W_Q8) { /* |w| by sign(x, w): signed x signed in maddubs' unsigned x signed */
        const __m256i ones = _mm256_set1_epi16(1);
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)qd);
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(qd + 32));
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        for (int i = 0; i < R; i++) {
            const __m256i xb = codes4(xq[i] + at);
            const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0));
            const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1));
            is[i][0] = _mm256_add_epi32(is[i][0], _mm256_madd_epi16(p0, ones));
            is[i][1] = _mm256_add_epi32(is[i][1], _mm256_madd_epi16(p1, ones));
            PIN(is[i][0]);
            PIN(is[i][1]);
        }
    } else { /* codes 0..15 unsigned: maddubs directly; 8 quads' int16 sums stay under 2^15 */
        const __m256i low = _mm256_set1_epi8(0x0f);
        const __m256i v = _mm256_loadu_si256((const __m256i *)qd);
        const __m256i w0 = _mm256_and_si256(v, low), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int i = 0; i < R; i++) {
            const __m256i xb = codes4(xq[i] + at);
            is[i][0] = _mm256_add_epi16(is[i][0], _mm256_maddubs_epi16(w0, xb));
            is[i][1] = _mm256_add_epi16(is[i][1], _mm256_maddubs_epi16(w1, xb));
            PIN(is[i][0]);
            PIN(is[i][1]);
        }
    }
#endif
}

/* x's rows r0 .. r0 + R - 1 as qdot_group reads them */
typedef struct {
    const int8_t *q[ROW_TILE];
    const float *d[ROW_TILE], *ds[ROW_TILE];
    const int32_t *s[ROW_TILE];
} qtile_t;

static AI void tile_rows(const int R, qtile_t *x, const qrows_t *r, int64_t r0, int64_t k) {
    const int64_t nb = k / QG;
    for (int i = 0; i < R; i++) {
        x->q[i] = r->q + (r0 + i) * k;
        x->d[i] = r->d + (r0 + i) * nb;
        x->s[i] = r->s + (r0 + i) * nb;
        x->ds[i] = r->ds + (r0 + i) * nb;
    }
}

/* Group g of one panel (its block at blk) for R rows of x, into acc[i][0:2] */
static AI void qdot_group(const int R, const int KIND, const uint8_t *blk, const qtile_t *x, int64_t g,
                          __m256 acc[][2]) {
    const int64_t qb = pd_quant_quad_bytes(KIND);
    const uint8_t *data = blk + pd_quant_header_bytes(KIND);
#if PD_QPREFETCH > 0
    for (int64_t b = 0; b < pd_quant_block_size(KIND); b += 64)
        _mm_prefetch((const char *)blk + PD_QPREFETCH + b, PD_QPREFETCH_HINT);
#endif
    __m256i is[ROW_TILE][2];
    for (int i = 0; i < R; i++) is[i][0] = is[i][1] = _mm256_setzero_si256();
    for (int t = 0; t < PD_QUADS; t++) quad_into(R, KIND, data + t * qb, x->q, g * QG + 4 * t, is);
    __m256 d0, d1, m0, m1;
    pd_block_scales(blk, KIND, &d0, &d1, &m0, &m1);
    for (int i = 0; i < R; i++)
        group_into(KIND, is[i][0], is[i][1], d0, d1, m0, m1, _mm256_set1_ps(x->d[i][g]), x->s[i][g], x->ds[i][g],
                   &acc[i][0], &acc[i][1]);
}

static AI void store_tile(const int R, __m256 acc[][2], float out[][NR]) {
    for (int i = 0; i < R; i++) {
        _mm256_storeu_ps(out[i], acc[i][0]);
        _mm256_storeu_ps(out[i] + 8, acc[i][1]);
    }
}

/* out[i][0:16] = row i's products with one panel (nb blocks at `panel`), rows i < R of r
 * from row r0. R and KIND are constants in each copy. */
static AI void qdot_panel(const int R, const int KIND, int64_t k, const uint8_t *panel, const qrows_t *r, int64_t r0,
                          float out[][NR]) {
    const int64_t nb = k / QG, bb = pd_quant_block_size(KIND);
    qtile_t x;
    tile_rows(R, &x, r, r0, k);
    __m256 acc[ROW_TILE][2];
    for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g++) qdot_group(R, KIND, panel + g * bb, &x, g, acc);
    store_tile(R, acc, out);
}

/* The same for two panels (pa -> oa, pb -> ob) in one pass, a group of each in turn: two
 * streams of blocks in flight for a decode batch of a few rows (qdot_pair1 interleaves
 * one row's two panels quad by quad instead). Each panel's arithmetic is qdot_panel's. */
static AI void qdot_two(const int R, const int KIND, int64_t k, const uint8_t *pa, const uint8_t *pb,
                        const qrows_t *r, int64_t r0, float oa[][NR], float ob[][NR]) {
    const int64_t nb = k / QG, bb = pd_quant_block_size(KIND);
    qtile_t x;
    tile_rows(R, &x, r, r0, k);
    __m256 acc[2][ROW_TILE][2];
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < R; i++) acc[p][i][0] = acc[p][i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g++) {
        qdot_group(R, KIND, pa + g * bb, &x, g, acc[0]);
        qdot_group(R, KIND, pb + g * bb, &x, g, acc[1]);
    }
    store_tile(R, acc[0], oa);
    store_tile(R, acc[1], ob);
}

/* One row's products with two panels in one pass (pa -> oa, pb -> ob): each panel's
 * arithmetic is qdot_panel's for one row (the same bits), the two interleaved quad by quad,
 * so that two streams of blocks are in flight and two independent chains of integer
 * products fill the pipes while lines arrive -- one decode row reads each weight once and
 * does little with it, and one panel at a time left the memory idle between its steps. */
static AI void qdot_pair1(const int KIND, int64_t k, const uint8_t *pa, const uint8_t *pb, const qrows_t *r,
                          int64_t r0, float oa[NR], float ob[NR]) {
    const int64_t nb = k / QG, bb = pd_quant_block_size(KIND), qb = pd_quant_quad_bytes(KIND);
    const int8_t *xq = r->q + r0 * k;
    const float *xd = r->d + r0 * nb, *xds = r->ds + r0 * nb;
    const int32_t *xs = r->s + r0 * nb;
    const uint8_t *panel[2] = {pa, pb};
    __m256 acc[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    for (int64_t g = 0; g < nb; g++) {
        const uint8_t *blk[2] = {panel[0] + g * bb, panel[1] + g * bb};
#if PD_QPREFETCH > 0
        for (int p = 0; p < 2; p++)
            for (int64_t b = 0; b < bb; b += 64) _mm_prefetch((const char *)blk[p] + PD_QPREFETCH + b, PD_QPREFETCH_HINT);
#endif
        __m256i is[2][2];
        for (int p = 0; p < 2; p++) is[p][0] = is[p][1] = _mm256_setzero_si256();
        for (int t = 0; t < PD_QUADS; t++) /* quad by quad: the two panels' chains side by side */
            for (int p = 0; p < 2; p++)
                quad_into(1, KIND, blk[p] + pd_quant_header_bytes(KIND) + t * qb, &xq, g * QG + 4 * t, &is[p]);
        const __m256 dx = _mm256_set1_ps(xd[g]);
        for (int p = 0; p < 2; p++) {
            __m256 d0, d1, m0, m1;
            pd_block_scales(blk[p], KIND, &d0, &d1, &m0, &m1);
            group_into(KIND, is[p][0], is[p][1], d0, d1, m0, m1, dx, xs[g], xds[g], &acc[p][0], &acc[p][1]);
        }
    }
    _mm256_storeu_ps(oa, acc[0][0]);
    _mm256_storeu_ps(oa + 8, acc[0][1]);
    _mm256_storeu_ps(ob, acc[1][0]);
    _mm256_storeu_ps(ob + 8, acc[1][1]);
}

#define QDOT_PAIR_COPY(KIND)                                                                                          \
    static void qdot_pair1_##KIND(int64_t k, const uint8_t *pa, const uint8_t *pb, const qrows_t *r, int64_t r0,      \
                                  float *oa, float *ob) {                                                              \
        qdot_pair1(KIND, k, pa, pb, r, r0, oa, ob);                                                                    \
    }
QDOT_PAIR_COPY(2)
QDOT_PAIR_COPY(3)
QDOT_PAIR_COPY(4)
typedef void (*qdot_pair_fn)(int64_t, const uint8_t *, const uint8_t *, const qrows_t *, int64_t, float *, float *);
static const qdot_pair_fn qdot_pairs[3] = {qdot_pair1_2, qdot_pair1_3, qdot_pair1_4};

/* Rows r0 .. r0 + rows - 1's products with panels pa (-> oa) and pb (-> ob) in one pass:
   qdot_pair1 for one row, qdot_two for more */
static void qdot_pair_rows(int kind, int rows, int64_t k, const uint8_t *pa, const uint8_t *pb, const qrows_t *r,
                           int64_t r0, float oa[][NR], float ob[][NR]);

#define QDOT_COPY(R, KIND)                                                                                             \
    static void qdot_##R##_##KIND(int64_t k, const uint8_t *p, const qrows_t *r, int64_t r0, float out[][NR]) {      \
        qdot_panel(R, KIND, k, p, r, r0, out);                                                                         \
    }
#define QDOT_COPIES(KIND) QDOT_COPY(1, KIND) QDOT_COPY(2, KIND) QDOT_COPY(3, KIND) QDOT_COPY(4, KIND)
QDOT_COPIES(2)
QDOT_COPIES(3)
QDOT_COPIES(4)
#define QDOT_TWO_COPY(R, KIND)                                                                                         \
    static void qdot_two_##R##_##KIND(int64_t k, const uint8_t *pa, const uint8_t *pb, const qrows_t *r, int64_t r0,  \
                                      float oa[][NR], float ob[][NR]) {                                                \
        qdot_two(R, KIND, k, pa, pb, r, r0, oa, ob);                                                                   \
    }
#define QDOT_TWO_COPIES(KIND) QDOT_TWO_COPY(2, KIND) QDOT_TWO_COPY(3, KIND) QDOT_TWO_COPY(4, KIND)
QDOT_TWO_COPIES(2)
QDOT_TWO_COPIES(3)
QDOT_TWO_COPIES(4)
typedef void (*qdot_two_fn)(int64_t, const uint8_t *, const uint8_t *, const qrows_t *, int64_t, float (*)[NR],
                            float (*)[NR]);
static const qdot_two_fn qdot_twos[3][ROW_TILE + 1] = {{0, 0, qdot_two_2_2, qdot_two_3_2, qdot_two_4_2},
                                                       {0, 0, qdot_two_2_3, qdot_two_3_3, qdot_two_4_3},
                                                       {0, 0, qdot_two_2_4, qdot_two_3_4, qdot_two_4_4}};
typedef void (*qdot_fn)(int64_t, const uint8_t *, const qrows_t *, int64_t, float (*)[NR]);
static const qdot_fn qdots[3][ROW_TILE + 1] = {{0, qdot_1_2, qdot_2_2, qdot_3_2, qdot_4_2},
                                               {0, qdot_1_3, qdot_2_3, qdot_3_3, qdot_4_3},
                                               {0, qdot_1_4, qdot_2_4, qdot_3_4, qdot_4_4}};

static void qdot_rows(int kind, int rows, int64_t k, const uint8_t *panel, const qrows_t *r, int64_t r0,
                      float out[][NR]) {
    qdots[kind - PD_W_Q8][rows](k, panel, r, r0, out);
}

static void qdot_pair_rows(int kind, int rows, int64_t k, const uint8_t *pa, const uint8_t *pb, const qrows_t *r,
                           int64_t r0, float oa[][NR], float ob[][NR]) {
    if (rows == 1)
        qdot_pairs[kind - PD_W_Q8](k, pa, pb, r, r0, oa[0], ob[0]);
    else
        qdot_twos[kind - PD_W_Q8][rows](k, pa, pb, r, r0, oa, ob);
}
#else
/* The plain C reading of the same sums (no AVX2) */
static void qdot_rows(int kind, int rows, int64_t k, const uint8_t *panel, const qrows_t *r, int64_t r0,
                      float out[][NR]) {
    const int64_t nb = k / QG, bb = pd_quant_block_size(kind), qb = pd_quant_quad_bytes(kind);
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < NR; c++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < nb; g++) {
                const uint8_t *blk = panel + g * bb, *data = blk + pd_quant_header_bytes(kind);
                const int8_t *xq = r->q + (r0 + i) * k + g * QG;
                int32_t isum = 0;
                for (int t = 0; t < PD_QUADS; t++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t *qd = data + t * qb;
                        const int w = kind == PD_W_Q8 ? (int8_t)qd[32 * (c / 8) + 4 * (c % 8) + j]
                                                      : (c < 8 ? qd[4 * c + j] & 15 : qd[4 * (c - 8) + j] >> 4);
                        isum += w * xq[4 * t + j];
                    }
                const int64_t gi = (r0 + i) * nb + g;
                const float ddx = pd_f16(blk + 2 * c) * r->d[gi];
                if (kind == PD_W_Q4M) {
                    const float t = ddx * (float)isum;
                    acc += fmaf(pd_f16(blk + 2 * NR + 2 * c), r->ds[gi], t);
                } else {
                    acc = fmaf(ddx, (float)(kind == PD_W_Q4 ? isum - 8 * r->s[gi] : isum), acc);
                }
            }
            out[i][c] = acc;
        }
}

/* Rows' products with panels pa and pb: the two one after the other */
static void qdot_pair_rows(int kind, int rows, int64_t k, const uint8_t *pa, const uint8_t *pb, const qrows_t *r,
                           int64_t r0, float oa[][NR], float ob[][NR]) {
    qdot_rows(kind, rows, k, pa, r, r0, oa);
    qdot_rows(kind, rows, k, pb, r, r0, ob);
}
#endif

/* Quantized x's rows for m rows of k, one allocation (freed with free(r->q)): 0 when out
 * of memory */
static int quantized_rows(qrows_t *r, const float *x, int64_t ldx, int64_t m, int64_t k) {
    const int64_t nb = m * (k / QG);
    r->q = malloc((size_t)(m * k + nb * (int64_t)(2 * sizeof(float) + sizeof(int32_t))));
    if (!r->q) return 0;
    r->d = (float *)(r->q + m * k); /* m k is a multiple of 32: aligned */
    r->s = (int32_t *)(r->d + nb);
    r->ds = (float *)(r->s + nb);
    pd_quantize_rows_q8(x, ldx, m, k, r->q, r->d, r->s);
    for (int64_t i = 0; i < nb; i++) r->ds[i] = r->d[i] * (float)r->s[i];
    return 1;
}

static int threads_for(int64_t macs, int64_t panels, int num_threads) {
    if (macs < PARALLEL_MIN_MACS) return 1;
    return panels < num_threads ? (int)(panels > 0 ? panels : 1) : num_threads;
}

/* y[0:m, 0:n] = x @ w^T (+ bias) for a quantized weight w (p: its packed panels) by
 * integer dot products (the header). Threads split the panels. Returns 0, 1 (bad
 * arguments) or 2 (out of memory). */
int QDOT_FN(pd_gemm_qdot)(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind,
                          const float *bias, float *y, int64_t ldy, int64_t n, int num_threads) {
    if (m < 0 || n < 0 || k <= 0 || k % QG || ldx < k || ldy < n || num_threads < 1 || !pd_quant_block_size(kind))
        return 1;
    if (m == 0 || n == 0) return 0;
    qrows_t r;
    if (!quantized_rows(&r, x, ldx, m, k)) return 2;
    const int64_t panels = (n + NR - 1) / NR, pbytes = k / QG * pd_quant_block_size(kind);
    const int threads = threads_for(m * n * k, panels, num_threads);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        float out[ROW_TILE][NR], out2[ROW_TILE][NR];
        const int64_t j0 = panels * t / threads, j1 = panels * (t + 1) / threads;
        if (m <= ROW_TILE) { /* a decode step of a few sequences: the thread's panels as two streams, its first
                                half's panel i with its second half's panel i in one pass (the odd one out alone) */
            const int64_t h = (j1 - j0 + 1) / 2;
            for (int64_t i = 0; i < h; i++) {
                const int64_t js[2] = {j0 + i, j0 + h + i};
                const int two = js[1] < j1;
                if (two)
                    qdot_pair_rows(kind, (int)m, k, (const uint8_t *)p + js[0] * pbytes,
                                   (const uint8_t *)p + js[1] * pbytes, &r, 0, out, out2);
                else
                    qdot_rows(kind, (int)m, k, (const uint8_t *)p + js[0] * pbytes, &r, 0, out);
                for (int e = 0; e <= two; e++) {
                    const int64_t j = js[e];
                    const int ncols = (j + 1) * NR <= n ? NR : (int)(n - j * NR);
                    for (int64_t ii = 0; ii < m; ii++)
                        for (int c = 0; c < ncols; c++)
                            y[ii * ldy + j * NR + c] = (e ? out2 : out)[ii][c] + (bias ? bias[j * NR + c] : 0.0f);
                }
            }
            continue;
        }
        for (int64_t r0 = 0; r0 < m; r0 += QMC) {
            const int64_t re = m - r0 < QMC ? m : r0 + QMC;
            for (int64_t j = panels * t / threads; j < panels * (t + 1) / threads; j++) {
                const int ncols = (j + 1) * NR <= n ? NR : (int)(n - j * NR);
                for (int64_t i = r0; i < re; i += ROW_TILE) {
                    const int rows = re - i < ROW_TILE ? (int)(re - i) : ROW_TILE;
                    qdot_rows(kind, rows, k, (const uint8_t *)p + j * pbytes, &r, i, out);
                    for (int ii = 0; ii < rows; ii++)
                        for (int c = 0; c < ncols; c++)
                            y[(i + ii) * ldy + j * NR + c] = out[ii][c] + (bias ? bias[j * NR + c] : 0.0f);
                }
            }
        }
    }
    free(r.q);
    return 0;
}

/* act = silu(x @ gate^T) * (x @ up^T) as pd_gemm_silu, for a quantized [gate; up] weight
 * (inter a multiple of 16) by pd_gemm_qdot's products: gate panel j and up panel inter / 16 + j
 * per pass. */
int QDOT_FN(pd_gemm_silu_qdot)(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind,
                               float *act, int64_t lda, int64_t inter, int num_threads) {
    if (m < 0 || k <= 0 || k % QG || inter <= 0 || inter % NR || ldx < k || lda < inter || num_threads < 1
        || !pd_quant_block_size(kind))
        return 1;
    if (m == 0) return 0;
    qrows_t r;
    if (!quantized_rows(&r, x, ldx, m, k)) return 2;
    const int64_t panels = inter / NR, pbytes = k / QG * pd_quant_block_size(kind);
    const int threads = threads_for(m * 2 * inter * k, panels, num_threads);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        float g[ROW_TILE][NR], u[ROW_TILE][NR];
        if (m <= ROW_TILE) { /* a few sequences: each gate panel with its up panel in one pass */
            for (int64_t j = panels * t / threads; j < panels * (t + 1) / threads; j++) {
                qdot_pair_rows(kind, (int)m, k, (const uint8_t *)p + j * pbytes,
                               (const uint8_t *)p + (panels + j) * pbytes, &r, 0, g, u);
                for (int64_t ii = 0; ii < m; ii++) pd_silu_mul_row(g[ii], u[ii], act + ii * lda + j * NR, NR);
            }
            continue;
        }
        for (int64_t r0 = 0; r0 < m; r0 += QMC) {
            const int64_t re = m - r0 < QMC ? m : r0 + QMC;
            for (int64_t j = panels * t / threads; j < panels * (t + 1) / threads; j++)
                for (int64_t i = r0; i < re; i += ROW_TILE) {
                    const int rows = re - i < ROW_TILE ? (int)(re - i) : ROW_TILE;
                    qdot_rows(kind, rows, k, (const uint8_t *)p + j * pbytes, &r, i, g);
                    qdot_rows(kind, rows, k, (const uint8_t *)p + (panels + j) * pbytes, &r, i, u);
                    for (int ii = 0; ii < rows; ii++) pd_silu_mul_row(g[ii], u[ii], act + (i + ii) * lda + j * NR, NR);
                }
        }
    }
    free(r.q);
    return 0;
}

#if PD_QDOT_DPBUSD == 0
/* The variants (the header's VNNI) and which one pd_gemm_qdot and pd_gemm_silu_qdot run */
#ifdef PD_QVNNI
int pd_gemm_qdot_avxvnni(const float *, int64_t, int64_t, int64_t, const void *, int, const float *, float *, int64_t,
                         int64_t, int);
int pd_gemm_qdot_avx512vnni(const float *, int64_t, int64_t, int64_t, const void *, int, const float *, float *,
                            int64_t, int64_t, int);
int pd_gemm_silu_qdot_avxvnni(const float *, int64_t, int64_t, int64_t, const void *, int, float *, int64_t, int64_t,
                              int);
int pd_gemm_silu_qdot_avx512vnni(const float *, int64_t, int64_t, int64_t, const void *, int, float *, int64_t,
                                 int64_t, int);
#endif

static int qdot_variant = 0; /* 0 maddubs, 1 AVX-VNNI, 2 AVX512-VNNI: set by pd_qdot_set_variant */

/* The variants this CPU (and OS) can run, as bits 1 << variant: maddubs always (bit 0) */
int pd_qdot_variants(void) {
    int bits = 1;
#ifdef PD_QVNNI
    __builtin_cpu_init();
#ifdef PD_QDOT_EMULATE_VNNI
    bits |= 1 << 1; /* the AVX-VNNI copy is emulated in AVX2 */
#else
    if (__builtin_cpu_supports("avxvnni")) bits |= 1 << 1;
#endif
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")) bits |= 1 << 2;
#endif
    return bits;
}

/* Run `variant` from now on: 0 on success, 1 (nothing changed) where it cannot run here */
int pd_qdot_set_variant(int variant) {
    if (variant < 0 || variant > 2 || !(pd_qdot_variants() >> variant & 1)) return 1;
    qdot_variant = variant;
    return 0;
}

int pd_qdot_variant(void) { return qdot_variant; }

int pd_gemm_qdot(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, const float *bias, float *y,
                 int64_t ldy, int64_t n, int num_threads) {
#ifdef PD_QVNNI
    if (qdot_variant == 1) return pd_gemm_qdot_avxvnni(x, ldx, m, k, p, kind, bias, y, ldy, n, num_threads);
    if (qdot_variant == 2) return pd_gemm_qdot_avx512vnni(x, ldx, m, k, p, kind, bias, y, ldy, n, num_threads);
#endif
    return pd_gemm_qdot_maddubs(x, ldx, m, k, p, kind, bias, y, ldy, n, num_threads);
}

int pd_gemm_silu_qdot(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, float *act,
                      int64_t lda, int64_t inter, int num_threads) {
#ifdef PD_QVNNI
    if (qdot_variant == 1) return pd_gemm_silu_qdot_avxvnni(x, ldx, m, k, p, kind, act, lda, inter, num_threads);
    if (qdot_variant == 2) return pd_gemm_silu_qdot_avx512vnni(x, ldx, m, k, p, kind, act, lda, inter, num_threads);
#endif
    return pd_gemm_silu_qdot_maddubs(x, ldx, m, k, p, kind, act, lda, inter, num_threads);
}
#endif
