/* y = x @ w^T (+ bias) on CPU, float32, with w pre-packed: every linear layer of the
 * CPU engine, decode batches and prefill chunks alike.
 *
 *   x     [m, k]  rows `ldx` apart, unit stride along k
 *   p     [ceil(n / 16), k, 16]  w [n, k] packed by kernels.cpu_native.pack_weight: panel j
 *         holds output columns 16 j .. 16 j + 15, k-major, zero past n
 *   bias  [n] or NULL
 *   y     [m, n]  rows `ldy` apart, written
 *
 * Why packed: a register tile of rows of x by one or two panels of y takes, per step of
 * k, one load per panel and one broadcast per row of x for its fused multiply-adds, with
 * no horizontal sums: on AVX2, 6 rows by one panel (12 accumulators of 8 lanes); on
 * AVX-512, 8 rows by two panels (16 accumulators of 16 lanes). A panel's slice of KC
 * steps is reused from L1 by every row group of x, whose rows are read where they lie,
 * MC at a time so that those a panel meets stay in L2 (so packing x as BLAS does gains
 * nothing measurable: the rows are read from L2 either way).
 * Threads split the panels in equal contiguous runs: each streams its own part of w,
 * which is what a decode batch of a few rows is bound by; splitting rows instead would
 * make every thread stream all of w. benchmarks/cpu_linear.py compares it with MKL
 * (`F.linear`) and oneDNN side by side.
 *
 * bf16 weights (pd_gemm_bf16, pd_gemm_silu_bf16): the same panels of 16-bit bfloat16
 * values (kernels.cpu_native.pack_weight(w, torch.bfloat16)), each widened to float32 in
 * registers as it is loaded (into the high half of a 32-bit lane: exact) and then the
 * same fused multiply-adds on float32 activations: half the bytes of w streamed, and the
 * product equals pd_gemm's on the widened weight bit for bit. Widening rather than
 * AVX512_BF16's vdpbf16ps: that instruction needs bf16 activations (one more rounding of
 * every input) and k-pair-interleaved panels (a second layout), and it sums pairs in its
 * own order, so the two ISA builds would stop agreeing; decode, the case bf16 is for, is
 * bound by the weight stream, which widening halves just the same. On AVX2 the few rows
 * of a decode step (float32 up to 5, bf16 up to 2) take panels two at a time, one from
 * each half of the thread's panels (run_panels_apart; bf16 prefetched ahead, see
 * tile_pair1_bf16 in gemm_tile_cpu.c), or the rows' few multiply-add chains, not the
 * memory, would set the pace. On one Zen 3 core, the builds alternated in one process:
 * SmolLM2's products at one row take 1/1.37 (float32) and 1/1.07 (bf16) of the time of
 * one panel at a time (float32) or neighbouring pairs (bf16) (benchmarks/decode_parts.py);
 * the small qwen3's linears at 3 / 4 / 5 float32 rows 1/1.32-1.39, 1/1.23-1.28 and
 * 1/1.07-1.16 in three runs (benchmarks/native_ab.py --what gemm).
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

#include "gemm_tile.h"

#define NR PD_NR /* columns per panel; kernels.cpu_native.PANEL */
#define MR PD_MR /* rows of x per register tile (gemm_tile_cpu.c) */
#define KC 192     /* k per panel slice (12 KB, in L1); MKL's own, see the top */
#define MC 96      /* rows of x per block */
#define PARALLEL_MIN_MACS 65536 /* below this one thread is faster than waking two */
#define PAIR_ROWS 3 /* rows of x per two-panel tile on AVX2 (12 accumulators) */
/* Decode rows up to which AVX2 pairs panels from two streams (run_panels_apart): float32
   in row chunks of PAIR_ROWS, the slices reread from L1 (past 5 rows the 6-row one-panel
   tile is as fast); bf16 one or two rows (a 3-row bf16 pair tile gained nothing steady,
   and chunks would widen every weight again) */
#define APART_ROWS_F32 5
#define APART_ROWS_BF16 2

/* One or two panels' tile on slices w0 (and w1) of k from the slice's start: float32 or
   bf16 panels ([kc][16] elements) as `kind` says. */
static inline void tile_any(int kind, int two, int rows, int64_t kc, const float *x, int64_t rs, const void *w0,
                            const void *w1, float *y, int64_t ldy, int accumulate, const float *bias, int ncols) {
    if (kind == PD_W_BF16) {
        if (two)
            pd_gemm_tile2_bf16(rows, kc, x, rs, 1, w0, w1, y, ldy, accumulate, bias, ncols);
        else
            pd_gemm_tile_bf16(rows, kc, x, rs, 1, w0, y, ldy, accumulate, bias, ncols);
    } else if (two) {
        pd_gemm_tile2(rows, kc, x, rs, 1, w0, w1, y, ldy, accumulate, bias, ncols);
    } else {
        pd_gemm_tile(rows, kc, x, rs, 1, w0, y, ldy, accumulate, bias, ncols);
    }
}

/* What the tile reads for weights k0 .. k0 + kc - 1 of panel j: the panel's own slice for
   float32 and bf16 panels; for a quantized one, that slice dequantized into `scratch`
   ([kc][16] floats, kc <= KC), whose float32 tile gives pd_gemm's bits on the dequantized
   weight. */
static inline const void *panel_slice(int kind, const void *p, int64_t k, int64_t j, int64_t k0, int64_t kc,
                                      float *scratch) {
    if (kind == PD_W_F32) return (const float *)p + (j * k + k0) * NR;
    if (kind == PD_W_BF16) return (const uint16_t *)p + (j * k + k0) * NR;
    pd_dequant_slice(kind, (const uint8_t *)p + j * (k / PD_QGROUP * pd_quant_block_bytes(kind)), k0, kc, scratch);
    return scratch;
}

/* The kind of panel the tile runs on: float32 for a quantized weight's dequantized slices */
static inline int tile_kind(int kind) { return kind == PD_W_BF16 ? PD_W_BF16 : PD_W_F32; }

/* Whether run_panels takes panels of this kind two at a time (a pair tile) */
#if defined(PD_PANEL_PAIRS)
#define panel_pairs(kind) 1
#elif defined(PD_BF16_PAIRS)
#define panel_pairs(kind) ((kind) == PD_W_BF16)
#else
#define panel_pairs(kind) 0
#endif

/* Whether a weight of this kind can have k inputs: a quantized one in whole groups. */
static inline int kind_fits(int kind, int64_t k) {
    return kind == PD_W_F32 || kind == PD_W_BF16 || (pd_quant_block_bytes(kind) > 0 && k % PD_QGROUP == 0);
}

/* MKL's split of k (see the top): two equal halves up to 2 KC, KC at a time past it. */
static inline int64_t k_step(int64_t k) { return k > KC && k <= 2 * KC ? k / 2 : KC; }

#if defined(PD_BF16_PAIRS)
/* run_panels for the few rows of a decode step on float32 or bf16 panels (AVX2):
 * panels [pb, pe) as two streams, the first half's panel i beside the second half's panel
 * i in one pair tile (the odd one out alone, last). Each stream reads its panels in order,
 * as SwiGLU's gate and up panels are read side by side (gemm_silu); neighbouring panels
 * (j, j + 1) as a pair leave the prefetcher two streams that jump at every pair, and one
 * panel at a time leaves a row's few multiply-add chains waiting on the memory. Every
 * output's chain is unchanged: the same bits. */
static void run_panels_apart(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind,
                             const float *bias, float *y, int64_t ldy, int64_t n, int64_t pb, int64_t pe) {
    const int64_t kstep = k_step(k), h = (pe - pb + 1) / 2;
    for (int64_t i = 0; i < h; i++) {
        const int64_t ja = pb + i, jb = pb + h + i;
        const int na = (ja + 1) * NR <= n ? NR : (int)(n - ja * NR), nb = (jb + 1) * NR <= n ? NR : (int)(n - jb * NR);
        for (int64_t k0 = 0; k0 < k; k0 += kstep) {
            const int64_t kc = k - k0 < kstep ? k - k0 : kstep;
            const float *ba = bias ? bias + ja * NR : 0, *bb = bias ? bias + jb * NR : 0;
            for (int64_t r = 0; r < m; r += PAIR_ROWS) { /* the slices stay in L1 for the next rows */
                const int rows = m - r < PAIR_ROWS ? (int)(m - r) : PAIR_ROWS;
                const float *xr = x + r * ldx + k0;
                float *ya = y + r * ldy + ja * NR, *yb = y + r * ldy + jb * NR;
                if (kind == PD_W_BF16) {
                    const uint16_t *wa = (const uint16_t *)p + (ja * k + k0) * NR;
                    const uint16_t *wb = (const uint16_t *)p + (jb * k + k0) * NR;
                    if (jb < pe)
                        pd_gemm_tile2_apart_bf16(rows, kc, xr, ldx, 1, wa, wb, ya, yb, ldy, k0 > 0, ba, bb, na, nb);
                    else
                        pd_gemm_tile_bf16(rows, kc, xr, ldx, 1, wa, ya, ldy, k0 > 0, ba, na);
                } else {
                    const float *wa = (const float *)p + (ja * k + k0) * NR, *wb = (const float *)p + (jb * k + k0) * NR;
                    if (jb < pe)
                        pd_gemm_tile2_apart(rows, kc, xr, ldx, 1, wa, wb, ya, yb, ldy, k0 > 0, ba, bb, na, nb);
                    else
                        pd_gemm_tile(rows, kc, xr, ldx, 1, wa, ya, ldy, k0 > 0, ba, na);
                }
            }
        }
    }
}
#endif

/* Panels [pb, pe) of y for m <= MC rows of x, each read where it lies, two panels at a
 * time where the tile takes them. A panel's k slices follow each other, so w streams in
 * its own order. */
static void run_panels(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, const float *bias,
                       float *y, int64_t ldy, int64_t n, int64_t pb, int64_t pe) {
#if defined(PD_BF16_PAIRS)
    if ((kind == PD_W_F32 && m <= APART_ROWS_F32) || (kind == PD_W_BF16 && m <= APART_ROWS_BF16)) {
        run_panels_apart(x, ldx, m, k, p, kind, bias, y, ldy, n, pb, pe);
        return;
    }
#endif
    const int64_t kstep = k_step(k);
    const int pairs = panel_pairs(kind), tkind = tile_kind(kind);
    float scratch[2][KC * NR]; /* a quantized weight's dequantized slices */
    for (int64_t j = pb, step; j < pe; j += step) {
        step = pairs && j + 1 < pe ? 2 : 1;
        const int ncols = (j + step) * NR <= n ? NR : (int)(n - (j + step - 1) * NR); /* of the last panel */
        const float *bj = bias ? bias + j * NR : 0;
        for (int64_t k0 = 0; k0 < k; k0 += kstep) {
            const int64_t kc = k - k0 < kstep ? k - k0 : kstep;
            const void *w0 = panel_slice(kind, p, k, j, k0, kc, scratch[0]);
            const void *w1 = step == 2 ? panel_slice(kind, p, k, j + 1, k0, kc, scratch[1]) : 0;
            for (int64_t i = 0; i < m; i += MR) {
                const int rows = m - i < MR ? (int)(m - i) : MR;
                tile_any(tkind, step == 2, rows, kc, x + i * ldx + k0, ldx, w0, w1, y + i * ldy + j * NR, ldy, k0 > 0,
                         bj, ncols);
            }
        }
    }
}

/* Thread t's panels of `panels` split between `threads`: [bound(t), bound(t + 1)), in
 * whole pairs where the tile takes two panels at once */
static inline int64_t bound(int64_t panels, int t, int threads, int pairs) {
    if (!pairs) return panels * t / threads;
    const int64_t b = (panels + 1) / 2 * t / threads * 2;
    return b < panels ? b : panels;
}

static int gemm(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, const float *bias,
                float *y, int64_t ldy, int64_t n, int num_threads) {
    if (m < 0 || n < 0 || k <= 0 || ldx < k || ldy < n || num_threads < 1 || !kind_fits(kind, k)) return 1;
    if (m == 0 || n == 0) return 0;
    if (m * n * k < PARALLEL_MIN_MACS) num_threads = 1;
    const int64_t panels = (n + NR - 1) / NR;
    if (panels < num_threads) num_threads = (int)panels;
    /* Threads split the panels: each streams only its part of w, MC rows of x at a time.
       OpenMP: inside a torch process this is torch's own libgomp and thread pool (same
       soname), so no second pool spins against torch's between calls. */
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int t = 0; t < num_threads; t++) {
        const int pairs = panel_pairs(kind);
        const int64_t pb = bound(panels, t, num_threads, pairs), pe = bound(panels, t + 1, num_threads, pairs);
        for (int64_t r0 = 0; r0 < m; r0 += MC)
            run_panels(x + r0 * ldx, ldx, m - r0 < MC ? m - r0 : MC, k, p, kind, bias, y + r0 * ldy, ldy, n, pb, pe);
    }
    return 0;
}

int pd_gemm(const float *x, int64_t ldx, int64_t m, int64_t k, const float *p, const float *bias, float *y,
            int64_t ldy, int64_t n, int num_threads) {
    return gemm(x, ldx, m, k, p, PD_W_F32, bias, y, ldy, n, num_threads);
}

/* pd_gemm on bf16 panels (see the top): float32 x, bias and y */
int pd_gemm_bf16(const float *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *p, const float *bias, float *y,
                 int64_t ldy, int64_t n, int num_threads) {
    return gemm(x, ldx, m, k, p, PD_W_BF16, bias, y, ldy, n, num_threads);
}

/* pd_gemm on panels of any kind (PD_W_*; quantized: gemm_quant_cpu.c, k a multiple of 32;
 * up to PD_QDOT_ROWS rows by int8 dot products, pd_gemm_qdot) */
int pd_gemm_q(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, const float *bias, float *y,
              int64_t ldy, int64_t n, int num_threads) {
    if (m <= PD_QDOT_ROWS && pd_quant_block_bytes(kind) > 0)
        return pd_gemm_qdot(x, ldx, m, k, p, kind, bias, y, ldy, n, num_threads);
    return gemm(x, ldx, m, k, p, kind, bias, y, ldy, n, num_threads);
}

/* pd_gemm_q by the float32 tile on dequantized slices at any m (pd_gemm's bits on the dequantized weight) */
int pd_gemm_q_dequant(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, const float *bias,
                      float *y, int64_t ldy, int64_t n, int num_threads) {
    return gemm(x, ldx, m, k, p, kind, bias, y, ldy, n, num_threads);
}

void pd_silu_mul_row(const float *g, const float *u, float *o, int64_t n); /* elementwise_cpu.c */

/* act = silu(x @ gate^T) * (x @ up^T), SwiGLU's gate and up projections and its
 * activation in one pass, with p = pack_weight([gate; up]) ([2 inter, k], inter a
 * multiple of NR): gate panel j and up panel inter / NR + j make one tile pair, whose
 * partial sums stay in a per-thread scratch of MC rows (in L1) until the last k slice,
 * then pd_silu_mul_row writes act's 16 columns. The [m, 2 inter] product is never
 * written out and read back. Each sum is pd_gemm's, in the same order, so act equals
 * pd_silu_mul(pd_gemm(x, p)) bit for bit. Threads split the gate panels. */
static int gemm_silu(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, float *act,
                     int64_t lda, int64_t inter, int num_threads) {
    if (m < 0 || k <= 0 || inter <= 0 || inter % NR || ldx < k || lda < inter || num_threads < 1
        || !kind_fits(kind, k))
        return 1;
    if (m == 0) return 0;
    if (m * 2 * inter * k < PARALLEL_MIN_MACS) num_threads = 1;
    const int64_t panels = inter / NR, kstep = k_step(k);
    if (panels < num_threads) num_threads = (int)panels;
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int t = 0; t < num_threads; t++) {
        float gu[MC * 2 * NR]; /* [MC rows][16 gate | 16 up] */
        float scratch[2][KC * NR]; /* a quantized weight's dequantized slices */
        const int tkind = tile_kind(kind);
        const int64_t pb = panels * t / num_threads, pe = panels * (t + 1) / num_threads;
        for (int64_t r0 = 0; r0 < m; r0 += MC) {
            const int64_t mb = m - r0 < MC ? m - r0 : MC;
            const float *xb = x + r0 * ldx;
            for (int64_t j = pb; j < pe; j++) {
                for (int64_t k0 = 0; k0 < k; k0 += kstep) {
                    const int64_t kc = k - k0 < kstep ? k - k0 : kstep;
                    const void *w0 = panel_slice(kind, p, k, j, k0, kc, scratch[0]);
                    const void *w1 = panel_slice(kind, p, k, panels + j, k0, kc, scratch[1]);
                    for (int64_t i = 0; i < mb; i += MR)
                        tile_any(tkind, 1, mb - i < MR ? (int)(mb - i) : MR, kc, xb + i * ldx + k0, ldx, w0, w1,
                                 gu + i * 2 * NR, 2 * NR, k0 > 0, 0, NR);
                }
                for (int64_t i = 0; i < mb; i++)
                    pd_silu_mul_row(gu + i * 2 * NR, gu + i * 2 * NR + NR, act + (r0 + i) * lda + j * NR, NR);
            }
        }
    }
    return 0;
}

int pd_gemm_silu(const float *x, int64_t ldx, int64_t m, int64_t k, const float *p, float *act, int64_t lda,
                 int64_t inter, int num_threads) {
    return gemm_silu(x, ldx, m, k, p, PD_W_F32, act, lda, inter, num_threads);
}

/* pd_gemm_silu on bf16 panels (see the top) */
int pd_gemm_silu_bf16(const float *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *p, float *act, int64_t lda,
                      int64_t inter, int num_threads) {
    return gemm_silu(x, ldx, m, k, p, PD_W_BF16, act, lda, inter, num_threads);
}

/* pd_gemm_silu on panels of any kind (PD_W_*; quantized: as pd_gemm_q) */
int pd_gemm_silu_q(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, float *act,
                   int64_t lda, int64_t inter, int num_threads) {
    if (m <= PD_QDOT_ROWS && pd_quant_block_bytes(kind) > 0)
        return pd_gemm_silu_qdot(x, ldx, m, k, p, kind, act, lda, inter, num_threads);
    return gemm_silu(x, ldx, m, k, p, kind, act, lda, inter, num_threads);
}

/* pd_gemm_silu_q by the float32 tile on dequantized slices at any m */
int pd_gemm_silu_q_dequant(const float *x, int64_t ldx, int64_t m, int64_t k, const void *p, int kind, float *act,
                           int64_t lda, int64_t inter, int num_threads) {
    return gemm_silu(x, ldx, m, k, p, kind, act, lda, inter, num_threads);
}
