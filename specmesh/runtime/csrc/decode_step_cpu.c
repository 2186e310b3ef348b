/* A few tokens of one or several sequences through a whole Llama-family decoder on the CPU, in one call: token
 * ids in, the logits of the rows asked for out, the new keys and values written where each sequence's block
 * table says. A target-only step is one token, a verify block K + 1, a short prefill chunk a few with no
 * logits; a batch of a few such. See cpu_kernels.py for why.
 *
 * The whole forward is one OpenMP parallel region, one pass over the weights from memory for every token of
 * the call. Where the build has AVX-512, or AVX2 and FMA, the weights are packed in panels of columns
 * (partial_panels) and the team splits a product's panels: each thread streams one contiguous run of the matrix
 * and writes whole columns, with the rows' sums in registers. Without panels a product splits the weights'
 * [in, out] rows over the team in fixed ranges (as gemv_cpu.c: splitting the columns of rows read 20-30 %
 * slower), eight rows a pass into private partial sums, which are summed in thread order where they are used
 * (the attention sums its own heads' q, k and v, the MLP gate and up). The small steps between products
 * (RMSNorm, SwiGLU) are recomputed by every thread into its own scratch rather than split, which costs less
 * than the barrier a split would need, and so is the residual stream (each thread keeps a copy, summed the
 * same way, so the copies agree to the bit): a layer is five barriers. The exception is a batch's SwiGLU over
 * panels (split_mlp), where the exponentials of every row made by every thread cost more than a sixth barrier
 * (16 x 5: -1-2 %).
 *
 * A token's row goes through the same arithmetic in the same order whatever the other rows of the call (the
 * products' column tiles, row pairs and panels' groups of rows only bound and share the loops; attention is per
 * row over its own visible keys), so a verify block's rows and the target-only steps that would decode the same
 * positions, alone or beside other sequences, compute bit-identical logits: greedy speculation on this path is
 * target-only decoding token for token, near-ties included, and a row's result does not depend on its batch.
 *
 * Attention is split by (sequence, KV head): the thread that owns one applies rotary to its keys and its query
 * heads, writes the keys and values into the pool and attends, so nothing it reads is written by another
 * thread; the attention itself is attend_rows.h's, as block_attention_cpu.c's. Built three times: over float
 * pools, over bfloat16 ones (SPECMESH_KV_BF16, the entries' names ending in _bf16; attend_rows.h), and over
 * float pools with the panels in bfloat16 (SPECMESH_PANELS_BF16, the names ending in _wbf16; see pw_t).
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attend_rows.h"
#include "rms_row.h"

/* The exported entries' names in this build */
#ifdef SPECMESH_PANELS_BF16
#define STEP_NAME(f) f##_wbf16
#else
#define STEP_NAME(f) KV_NAME(f)
#endif

enum { LN1, WQKV, BQKV, WO, BO, QN, KN, LN2, WGU, BGU, WD, BD, KPOOL, VPOOL, NPTR };
enum { EPS1, EPS2, SCALE, QN_EPS, KN_EPS, NFL };
enum { HID, NH, NKV, HD, INTER, VOCAB, LAYERS, BS, NSEQ, K_SH, K_SS, V_SH, V_SS, NTOK, NLOG, TW, PANELW, NDIM };

/* With several rows a product's columns go in tiles, so that the eight weight rows' tile stays in L1 while
 * every token's partial takes it; one row streams whole rows. */
#define TILE 512

/* From this many rows in a call the team splits the SwiGLU's rows over panels (see split_mlp) */
#define SPLIT_MLP_ROWS 4

/* acc[j] += x[0..8) . the eight weight rows' column j, for j in [0, w): the one expression every token's row
 * goes through, whatever the number of rows (the same arithmetic for a verify block and a one-token step). */
#define EIGHT(acc, x, c, w)                                                                                    \
    do {                                                                                                       \
        const float x0 = (x)[0], x1 = (x)[1], x2 = (x)[2], x3 = (x)[3];                                        \
        const float x4 = (x)[4], x5 = (x)[5], x6 = (x)[6], x7 = (x)[7];                                        \
        _Pragma("omp simd") for (int64_t j = 0; j < (w); j++)(acc)[j] +=                                       \
            (x0 * s0[(c) + j] + x1 * s1[(c) + j] + x2 * s2[(c) + j] + x3 * s3[(c) + j]) +                      \
            (x4 * s4[(c) + j] + x5 * s5[(c) + j] + x6 * s6[(c) + j] + x7 * s7[(c) + j]);                       \
    } while (0)

/* EIGHT for two token rows at once: each weight read from L1 serves both (the same expression per row) */
#define EIGHT2(acc, accb, x, xb, c, w)                                                                        \
    do {                                                                                                       \
        const float x0 = (x)[0], x1 = (x)[1], x2 = (x)[2], x3 = (x)[3];                                        \
        const float x4 = (x)[4], x5 = (x)[5], x6 = (x)[6], x7 = (x)[7];                                        \
        const float y0 = (xb)[0], y1 = (xb)[1], y2 = (xb)[2], y3 = (xb)[3];                                    \
        const float y4 = (xb)[4], y5 = (xb)[5], y6 = (xb)[6], y7 = (xb)[7];                                    \
        _Pragma("omp simd") for (int64_t j = 0; j < (w); j++) {                                                \
            const float a0 = s0[(c) + j], a1 = s1[(c) + j], a2 = s2[(c) + j], a3 = s3[(c) + j];                \
            const float a4 = s4[(c) + j], a5 = s5[(c) + j], a6 = s6[(c) + j], a7 = s7[(c) + j];                \
            (acc)[j] += (x0 * a0 + x1 * a1 + x2 * a2 + x3 * a3) + (x4 * a4 + x5 * a5 + x6 * a6 + x7 * a7);     \
            (accb)[j] += (y0 * a0 + y1 * a1 + y2 * a2 + y3 * a3) + (y4 * a4 + y5 * a5 + y6 * a6 + y7 * a7);    \
        }                                                                                                      \
    } while (0)

/* This thread's partials of rows x[0, n) (ldx apart) . S over its fixed range of S's rows (multiples of 8):
 * part[r * lp + (0, out)]. Eight weight rows per pass over a partial: one load and store of it per eight
 * weights read (four rows a pass measured ~34 GB/s over the demo target's matrices on 2 threads, eight ~40);
 * a block of rows reads the weights from memory once. */
static inline int64_t share_end(int64_t in, int t, int T) {
    return t == T - 1 ? in : 8 * (((in + 7) / 8) * (t + 1) / T);
}
static inline int64_t share_start(int64_t in, int t, int T) { return 8 * (((in + 7) / 8) * t / T); }

static void partial(float *part, int64_t lp, const float *x, int64_t ldx, int64_t n, const float *S, int64_t in,
                    int64_t out, int t, int T) {
    const int64_t tile = n == 1 ? out : TILE, i1 = share_end(in, t, T);
    int64_t i = share_start(in, t, T);
    for (int64_t r = 0; r < n; r++) memset(part + r * lp, 0, sizeof(float) * out);
    for (; i + 8 <= i1; i += 8) {
        const float *s0 = S + i * out, *s1 = s0 + out, *s2 = s1 + out, *s3 = s2 + out;
        const float *s4 = s3 + out, *s5 = s4 + out, *s6 = s5 + out, *s7 = s6 + out;
        for (int64_t c = 0; c < out; c += tile) {
            const int64_t w = out - c < tile ? out - c : tile;
            int64_t r = 0;
            for (; r + 2 <= n; r += 2)
                EIGHT2(part + r * lp + c, part + (r + 1) * lp + c, x + r * ldx + i, x + (r + 1) * ldx + i, c, w);
            if (r < n) EIGHT(part + r * lp + c, x + r * ldx + i, c, w);
        }
    }
    for (; i < i1; i++) {
        const float *s = S + i * out;
        for (int64_t r = 0; r < n; r++) {
            const float xi = x[r * ldx + i];
            float *acc = part + r * lp;
#pragma omp simd
            for (int64_t j = 0; j < out; j++) acc[j] += xi * s[j];
        }
    }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
/* Weights packed in panels (specmesh_decode_step_panel): S [in, out] as [out / PANEL][in][PANEL], the last
 * panel's missing columns zero. A thread takes a fixed range of whole panels, one contiguous run of the
 * matrix, which it streams once from memory for the call's first rows and then again from its L2 (a panel is
 * in x PANEL x 4 bytes) for each further group of rows. Splitting the panels' rows instead (each thread half of
 * every panel, partials summed across the team) was 5-20 % slower on the demo target, one token to 16 x 5, the
 * more so the faster the memory. In registers, up to six rows' sums of the panel's PV vectors, one fused
 * multiply-add a weight and row: a verify block costs little more than its weights' read (5 rows of the demo
 * target's matrices 3.5-3.9 ms against 6.2 for the eight-row passes over [in, out] rows, whose every partial
 * goes through the L1 once per eight weight rows; 16 rows 7.3 against 9.5, as oneDNN's packed GEMM). Each row's
 * sum is the same chain of multiply-adds over all of S's rows in order, whatever the other rows of the call and
 * the number of threads: the intrinsics' fused multiply-adds are never regrouped by the compiler, so the bits
 * depend on neither.
 * A panel is as many columns as six rows' sums fill the registers with: with AVX-512 (32 registers of 16 floats)
 * 64 columns, 24 sums beside the panel's 4 vectors; with AVX2 and FMA (16 of 8) 16 columns, 12 sums beside 2
 * vectors and a row's broadcast (BLIS's 6 x 16 kernel for that machine). */
#if defined(__AVX512F__)
enum { PANEL = 64, VL = 16 };
typedef __m512 pvec;
#define PV_ZERO() _mm512_setzero_ps()
#define PV_SET1(x) _mm512_set1_ps(x)
#define PV_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define PV_STORE(p, v) _mm512_storeu_ps(p, v)
#else
enum { PANEL = 16, VL = 8 };
typedef __m256 pvec;
#define PV_ZERO() _mm256_setzero_ps()
#define PV_SET1(x) _mm256_set1_ps(x)
#define PV_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define PV_STORE(p, v) _mm256_storeu_ps(p, v)
#endif
enum { PV = PANEL / VL };

/* The panels' element. A build with SPECMESH_PANELS_BF16 reads them in bfloat16, each widened to float exactly
 * on load (everything after it float32, as for float panels): half the bytes a product streams, for a model
 * whose numerics may change as long as they stay fixed, a draft's (what it proposes is checked by the target;
 * its distribution is whatever the step computes). A one-row step is bound by its weights' stream, so half the
 * bytes is most of the gain (the demo draft's step at one thread 0.65 -> 0.40 ms), two more instructions a
 * vector of weights the price. LINE: elements a cache line; PL: whole lines in a panel's row of PANEL elements
 * (none where it is half a line: AVX2's panels in bfloat16, which are not fetched ahead). */
#ifdef SPECMESH_PANELS_BF16
typedef uint16_t pw_t;
static inline __attribute__((always_inline)) pvec panel_load(const pw_t *p) {
#if defined(__AVX512F__)
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#else
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#endif
}
#else
typedef float pw_t;
static inline __attribute__((always_inline)) pvec panel_load(const pw_t *p) {
#if defined(__AVX512F__)
    return _mm512_loadu_ps(p);
#else
    return _mm256_loadu_ps(p);
#endif
}
#endif
enum { LINE = 64 / (int)sizeof(pw_t), PL = PANEL / LINE };

#define PANEL_ROWS(R)                                                                                              \
    static inline __attribute__((always_inline)) void panel_rows##R(float *part, int64_t lp, const float *x,       \
                                                                    int64_t ldx, const pw_t *P, int64_t in,        \
                                                                    const pw_t *pf, int lines) {                   \
        pvec acc[R][PV];                                                                                           \
        for (int r = 0; r < R; r++)                                                                                \
            for (int v = 0; v < PV; v++) acc[r][v] = PV_ZERO();                                                    \
        for (int64_t k = 0; k < in; k++) {                                                                         \
            for (int l = 0; pf && l < lines; l++)                                                                  \
                _mm_prefetch((const char *)(pf + LINE * (k * lines + l)), _MM_HINT_T1);                            \
            pvec w[PV];                                                                                            \
            for (int v = 0; v < PV; v++) w[v] = panel_load(P + k * PANEL + VL * v);                                \
            for (int r = 0; r < R; r++) {                                                                          \
                const pvec xr = PV_SET1(x[r * ldx + k]);                                                           \
                for (int v = 0; v < PV; v++) acc[r][v] = PV_FMA(xr, w[v], acc[r][v]);                              \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int v = 0; v < PV; v++) PV_STORE(part + r * lp + VL * v, acc[r][v]);                              \
    }
PANEL_ROWS(1)
PANEL_ROWS(2)
PANEL_ROWS(3)
PANEL_ROWS(4)
PANEL_ROWS(5)
PANEL_ROWS(6)

/* One row over WIDE panels at once (a one-token step): each column's sum the same chain of multiply-adds as
 * panel_rows1's, so the same bits. Where a panel is two vectors (AVX2), one row of one panel is two chains of
 * dependent multiply-adds, one line of weights per multiply-add's latency: ~40 GB/s a core at best, under
 * what a core streams. Four panels make eight chains. With AVX-512 a panel's four vectors already are four. */
enum { WIDE = PV >= 4 ? 1 : 8 / PV };
static inline __attribute__((always_inline)) void panel_row_wide(float *part, const float *x, const pw_t *P,
                                                                 int64_t in) {
    pvec acc[WIDE][PV];
    for (int q = 0; q < WIDE; q++)
        for (int v = 0; v < PV; v++) acc[q][v] = PV_ZERO();
    for (int64_t k = 0; k < in; k++) {
        const pvec xr = PV_SET1(x[k]);
        for (int q = 0; q < WIDE; q++)
            for (int v = 0; v < PV; v++)
                acc[q][v] = PV_FMA(xr, panel_load(P + (q * in + k) * PANEL + VL * v), acc[q][v]);
    }
    for (int q = 0; q < WIDE; q++)
        for (int v = 0; v < PV; v++) PV_STORE(part + q * PANEL + VL * v, acc[q][v]);
}

/* The whole products x . S of this thread's panels, written into the one set of sums the team shares:
 * part[r * lp + c, for the panels' columns c] (the last panel's padding columns included).
 * With more than one group of rows a panel's first group waits on the panel's read while the later ones take
 * it from the L2: the groups fetch the thread's next panel into the L2 as they go (pf, `lines` lines of it per
 * k, the first PV / lines groups between them), so a batch's product no longer pays each panel's read on top
 * of its arithmetic (16 x 5 over the demo target's matrices 17.2 -> 13.8 ms, 335 -> 420 GFLOP/s on two
 * cores). One group (a step or a verify block of up to 6 rows) streams the weights from memory anyway, and
 * there the fetching ahead measured slower. Nothing it does touches the arithmetic. */
/* The part of the next panel group g of rows fetches (`lines` lines per k of its in rows), NULL past the panel */
static inline const pw_t *ahead(const pw_t *next, int64_t g, int lines, int64_t in) {
    return next && g * lines < PL ? next + g * in * LINE * lines : NULL;
}

static void partial_panels(float *part, int64_t lp, const float *x, int64_t ldx, int64_t n, const pw_t *S,
                           int64_t in, int64_t out, int t, int T) {
    const int64_t np = (out + PANEL - 1) / PANEL, groups = (n + 5) / 6;
    const int lines = groups >= PL ? 1 : (int)((PL + groups - 1) / groups); /* of the next panel, per k */
    int64_t c = np * t / T * PANEL;
    const int64_t c1 = np * (t + 1) / T * PANEL;
    if (WIDE > 1 && n == 1)
        for (; c + WIDE * PANEL <= c1; c += WIDE * PANEL) panel_row_wide(part + c, x, S + c * in, in);
    for (; c < c1; c += PANEL) {
        const pw_t *P = S + c * in, *next = c + PANEL < c1 && groups > 1 ? P + PANEL * in : NULL;
        int64_t r = 0, g = 0;
        for (; r + 6 <= n; r += 6, g++)
            panel_rows6(part + r * lp + c, lp, x + r * ldx, ldx, P, in, ahead(next, g, lines, in), lines);
        const pw_t *pf = ahead(next, g, lines, in);
        switch (n - r) {
        case 5: panel_rows5(part + r * lp + c, lp, x + r * ldx, ldx, P, in, pf, lines); break;
        case 4: panel_rows4(part + r * lp + c, lp, x + r * ldx, ldx, P, in, pf, lines); break;
        case 3: panel_rows3(part + r * lp + c, lp, x + r * ldx, ldx, P, in, pf, lines); break;
        case 2: panel_rows2(part + r * lp + c, lp, x + r * ldx, ldx, P, in, pf, lines); break;
        case 1: panel_rows1(part + r * lp + c, lp, x + r * ldx, ldx, P, in, pf, lines); break;
        default: break;
        }
    }
}
#define PANELS_BUILT 1
#else
enum { PANEL = 0 };
#define PANELS_BUILT 0
#endif

/* The panel width the weights are to be packed in for this build (0: [in, out] rows, no packing) */
int STEP_NAME(specmesh_decode_step_panel)(void) { return PANEL; }

/* A product in the weights' layout: panels (dims[PANELW] != 0, never in a build without them) write whole sums
 * into the team's one set, rows this thread's partials into its own */
static inline void product(int panels, float *part, int64_t lp, const float *x, int64_t ldx, int64_t n,
                           const void *S, int64_t in, int64_t out, int t, int T) {
#if PANELS_BUILT
    if (panels) {
        partial_panels(part, lp, x, ldx, n, (const pw_t *)S, in, out, t, T);
        return;
    }
#endif
    (void)panels;
    partial(part, lp, x, ldx, n, (const float *)S, in, out, t, T);
}

/* An output's `sets` partials summed in thread order (one with panels), plus the bias */
static inline float total(const float *parts, int64_t stride, int T, const float *b, int64_t j) {
    float v = 0.f;
    for (int u = 0; u < T; u++) v += parts[u * stride + j];
    return b ? v + b[j] : v;
}

/* y[d] = total(pr, stride, T, b, o + d) for d < cnt (y += that where add): with one set (panels) as plain
 * vector loops, the same sums as total's; the per-element loop over the sets kept 80 rows' worth of them scalar */
static inline void totals(float *y, const float *pr, int64_t stride, int T, const float *b, int64_t o, int64_t cnt,
                          int add) {
    pr += o;
    b = b ? b + o : NULL;
    if (T == 1) {
#pragma omp simd
        for (int64_t d = 0; d < cnt; d++) {
            const float v = b ? (0.f + pr[d]) + b[d] : 0.f + pr[d];
            y[d] = add ? y[d] + v : v;
        }
        return;
    }
    for (int64_t d = 0; d < cnt; d++) {
        const float v = total(pr, stride, T, b, d);
        y[d] = add ? y[d] + v : v;
    }
}

/* y[r][j] = x . S + b for every row r, over this thread's share of the columns, once every sum is in */
static void reduce(float *y, int64_t ldy, const float *parts, int64_t stride, int64_t lp, int64_t n,
                   const float *b, int64_t out, int t, int T, int sets) {
    const int64_t j0 = out * t / T, j1 = out * (t + 1) / T;
    for (int64_t r = 0; r < n; r++) totals(y + r * ldy + j0, parts + r * lp, stride, sets, b, j0, j1 - j0, 0);
}

/* x[r][j] += x . S + b for every row and every column: the residual stream, which every thread keeps a copy
 * of (the same sums in the same order, so the copies agree to the bit) rather than split it and wait */
static void residual(float *x, const float *parts, int64_t stride, int64_t lp, int64_t n, const float *b, int64_t H,
                     int T) {
    for (int64_t r = 0; r < n; r++) totals(x + r * H, parts + r * lp, stride, T, b, 0, H, 1);
}

static void rope(float *x, const float *cos, const float *sin, int64_t D) {
    float tmp[512];
    const int64_t half = D / 2;
    memcpy(tmp, x, sizeof(float) * D);
    for (int64_t d = 0; d < half; d++) x[d] = tmp[d] * cos[d] + tmp[d + half] * sin[d];
    for (int64_t d = half; d < D; d++) x[d] = tmp[d] * cos[d] + tmp[d - half] * sin[d];
}

/* Rows r = t G + g (token t of n at position start + t, query head g of the KV head's G) attend over positions
 * [0, start + t]: out row r (ldo apart per token) = softmax(q_r . K) . V. q: [n G, D], rotated. */
static void attend(float *out, int64_t ldo, const float *q, const kv_t *kb, const kv_t *vb, const int32_t *table,
                   int64_t start, int64_t n, int64_t bs, int64_t ks, int64_t vs, int64_t G, int64_t D, float scale,
                   float *qb, float *acc, float *sc, const next_unit *nx) {
    /* a score row's stride padded to whole cache lines: every row starts aligned, so a row's sums (the
     * softmax's) group the same way whatever the call's length (an alignment peel would regroup them) */
    const int64_t R = n * G, E = (start + n + 15) / 16 * 16;
    for (int64_t r = 0; r < R; r++)
        for (int64_t d = 0; d < D; d++) qb[r * D + d] = q[r * D + d] * scale;
    if (D == 64) /* the common head sizes as constants: the rows' vectors stay in registers */
        attend_rows(acc, qb, kb, vb, table, start, n, G, 64, bs, ks, vs, sc, E, nx);
    else if (D == 128)
        attend_rows(acc, qb, kb, vb, table, start, n, G, 128, bs, ks, vs, sc, E, nx);
    else
        attend_rows(acc, qb, kb, vb, table, start, n, G, D, bs, ks, vs, sc, E, nx);
    for (int64_t r = 0; r < R; r++) memcpy(out + (r / G) * ldo + (r % G) * D, acc + r * D, sizeof(float) * D);
}

/* Where a call's time goes (the `phases` argument, each thread's clock, the team's mean added): the products of
 * the layers, attention (a unit's sums, norm, rotary, KV write and attend), the small steps between products
 * (norms, residual sums, SwiGLU), the wait at barriers (the team's imbalance), and the logits (final norm, LM
 * head, their sums). */
enum { PH_PRODUCTS, PH_ATTENTION, PH_ELEMENTWISE, PH_BARRIER, PH_LOGITS, NPHASE };
int STEP_NAME(specmesh_decode_step_phases)(void) { return NPHASE; }
/* the time since the last mark to phase c (when timing) */
#define PHASE(c)                                                                                               \
    do {                                                                                                       \
        if (phases) {                                                                                          \
            const double now_ = omp_get_wtime();                                                               \
            ph[c] += now_ - mark;                                                                              \
            mark = now_;                                                                                       \
        }                                                                                                      \
    } while (0)
#define BARRIER(c)                                                                                             \
    do {                                                                                                       \
        PHASE(c);                                                                                              \
        _Pragma("omp barrier");                                                                                \
        PHASE(PH_BARRIER);                                                                                     \
    } while (0)

/* dims: NDIM values (the enum above: the model's sizes; the sequences, the tokens of all of them, the logits
 * rows wanted; the KV pools' strides in elements, head and slot; the block tables' width; the weights' panel
 * width, 0 for rows). ptrs: NPTR per layer (weights [in, out] with rows `out` floats apart, or packed in panels
 * of specmesh_decode_step_panel() columns; biases, q/k norms may be NULL; the layer's K and V pools).
 * fl: NFL per layer. embed: the embedding [vocab, H]; tokens: NTOK ids (checked by the caller), sequence after
 * sequence. segs: per sequence (first row, tokens, first position); tables: per sequence TW block ids. cos,
 * sin: the rotary tables [positions, D] (rotate_half's sign folded into sin). lrows: the NLOG rows whose logits
 * go to logits [NLOG, V]. phases: NULL, or [NPHASE] seconds: the call adds the team's mean time in each phase
 * (the verify service's counters, bench.roofline's breakdown), which costs it ~10 clock reads a layer per thread.
 * Returns 0, or -1 when scratch could not be allocated (then nothing was written). */
int STEP_NAME(specmesh_decode_step)(const int64_t *dims, void *const *ptrs, const float *fl, const float *embed,
                         const int64_t *tokens, const int64_t *segs, const int32_t *tables, const float *cos,
                         const float *sin, const float *norm_w, float norm_eps, const void *lm_w, const float *lm_b,
                         const int64_t *lrows, float *logits, int threads, double *phases) {
    const int64_t H = dims[HID], nh = dims[NH], nkv = dims[NKV], D = dims[HD], I = dims[INTER], V = dims[VOCAB];
    const int64_t L = dims[LAYERS], bs = dims[BS], S = dims[NSEQ], n = dims[NTOK], nlog = dims[NLOG];
    const int64_t G = nh / nkv, nqkv = (nh + 2 * nkv) * D, A = nh * D, units = S * nkv;
    const int pw = dims[PANELW] != 0; /* the weights in panels of PANEL columns */
    if (D > 512 || D % 2 || n < 1 || S < 1 || nlog < 0 || nlog > n || (pw && dims[PANELW] != PANEL)) return -2;
#ifdef SPECMESH_PANELS_BF16
    if (!pw) return -2; /* bfloat16 weights come in panels only */
#endif
    int64_t most = 1, far = 16; /* the most tokens of one sequence; its padded end */
    for (int64_t i = 0; i < S; i++) {
        const int64_t ns = segs[3 * i + 1], e = (segs[3 * i + 2] + ns + 15) / 16 * 16;
        most = ns > most ? ns : most;
        far = e > far ? e : far;
    }
    if (threads < 1) threads = 1;
    int64_t widest = nqkv > 2 * I ? nqkv : 2 * I;
    widest = widest > V ? widest : V;
    widest = ((widest > H ? widest : H) + 63) / 64 * 64; /* panels write whole panels' columns */
    /* a partial row's length, padded by a cache line so that the rows of a block do not share cache sets (at
     * a power of two apart, nine rows' partials thrashed one set of the L1); one thread's partials */
    const int64_t lp = widest + 16, stride = n * lp;
    /* shared: attn [n, nh D], two sets of partials [T, n, lp], [n, lp] over panels (a product's partials are
     * read while the next product writes the other set); per thread: x and h [n, H], m [n, I]; for one
     * sequence's unit q [most G, D], k and v [most, D], qb and acc [most G, D], sc [most G, far]; up, a row's
     * up projections [I] */
    const int64_t sets_max = pw ? 1 : threads; /* panels write whole sums: one set whatever the team */
    /* Over panels every thread's share of the down product reads every row of the SwiGLU's output: for a batch
     * the team splits those rows and shares them [n, I] (one more barrier), for a few rows each thread makes
     * them all, which costs less than the barrier */
    const int split_mlp = pw && threads > 1 && n >= SPLIT_MLP_ROWS;
    const int64_t shared = (n * A + 15) / 16 * 16 + 2 * stride * sets_max + (split_mlp ? (n * I + 15) / 16 * 16 : 0);
    const int64_t own = (n * (2 * H + I) + I + most * (3 * G * D + 2 * D + G * far) + 15) / 16 * 16;
    float *buf = aligned_alloc(64, ((size_t)(shared + own * threads) * sizeof(float) + 63) / 64 * 64);
    if (!buf) return -1;
    float *attn = buf, *pa = buf + (n * A + 15) / 16 * 16, *pb = pa + stride * sets_max, *priv = buf + shared;
    float *ms = pb + stride * sets_max; /* the shared SwiGLU rows, where split_mlp */
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* sets: how many partial sums a product leaves per output (panels write whole sums) */
        const int t = omp_get_thread_num(), T = omp_get_num_threads(), sets = pw ? 1 : T;
        float *x = priv + (int64_t)t * own, *h = x + n * H, *m = h + n * H, *q = m + n * I, *k = q + most * G * D;
        float *v = k + most * D;
        float *qb = v + most * D, *acc = qb + most * G * D, *sc = acc + most * G * D, *up = sc + most * G * far;
        float *mine_a = pa + (pw ? 0 : (int64_t)t) * stride, *mine_b = pb + (pw ? 0 : (int64_t)t) * stride;
        double ph[NPHASE] = {0}, mark = phases ? omp_get_wtime() : 0.0;
        const unsigned fp_mode = flush_denormals();
        for (int64_t r = 0; r < n; r++) memcpy(x + r * H, embed + tokens[r] * H, sizeof(float) * H);
        for (int64_t l = 0; l < L; l++) {
            void *const *p = ptrs + l * NPTR;
            const float *f = fl + l * NFL, *bqkv = p[BQKV];
            for (int64_t r = 0; r < n; r++) rms_row(h + r * H, x + r * H, p[LN1], f[EPS1], H);
            PHASE(PH_ELEMENTWISE);
            product(pw, mine_a, lp, h, H, n, p[WQKV], H, nqkv, t, T);
            BARRIER(PH_PRODUCTS);
            for (int64_t u = units * t / T, u1 = units * (t + 1) / T; u < u1; u++) {
                next_unit nx = {NULL, NULL, NULL, 0};
                if (u + 1 < u1) { /* the next unit's keys and values on their way while this one computes */
                    const int64_t s = (u + 1) / nkv, h = (u + 1) % nkv;
                    nx = (next_unit){(kv_t *)p[KPOOL] + h * dims[K_SH], (kv_t *)p[VPOOL] + h * dims[V_SH],
                                     tables + s * dims[TW], segs[3 * s + 2] + segs[3 * s + 1]};
                }
                /* one sequence's KV head: its query heads, keys and values, summed from the partials */
                const int64_t sq = u / nkv, kh = u % nkv, off = segs[3 * sq], ns = segs[3 * sq + 1];
                const int64_t start = segs[3 * sq + 2];
                const int32_t *table = tables + sq * dims[TW];
                const int64_t qo = kh * G * D, ko = (nh + kh) * D, vo = (nh + nkv + kh) * D;
                kv_t *kp = (kv_t *)p[KPOOL] + kh * dims[K_SH], *vp = (kv_t *)p[VPOOL] + kh * dims[V_SH];
                for (int64_t i = 0; i < ns; i++) {
                    const float *pr = pa + (off + i) * lp, *c = cos + (start + i) * D, *s = sin + (start + i) * D;
                    float *qr = q + i * G * D, *kr = k + i * D, *vr = v + i * D;
                    totals(qr, pr, stride, sets, bqkv, qo, G * D, 0);
                    totals(kr, pr, stride, sets, bqkv, ko, D, 0);
                    totals(vr, pr, stride, sets, bqkv, vo, D, 0);
                    for (int64_t g = 0; g < G; g++) {
                        if (p[QN]) rms_row(qr + g * D, qr + g * D, p[QN], f[QN_EPS], D);
                        rope(qr + g * D, c, s, D);
                    }
                    if (p[KN]) rms_row(kr, kr, p[KN], f[KN_EPS], D);
                    rope(kr, c, s, D);
                    const int64_t at = start + i, slot = (int64_t)table[at / bs] * bs + at % bs;
                    kv_put(kp + slot * dims[K_SS], kr, D);
                    kv_put(vp + slot * dims[V_SS], vr, D);
                }
                attend(attn + off * A + qo, A, q, kp, vp, table, start, ns, bs, dims[K_SS], dims[V_SS], G, D,
                       f[SCALE], qb, acc, sc, u + 1 < u1 ? &nx : NULL);
            }
            BARRIER(PH_ATTENTION);
            product(pw, mine_b, lp, attn, A, n, p[WO], A, H, t, T);
            BARRIER(PH_PRODUCTS);
            residual(x, pb, stride, lp, n, p[BO], H, sets);
            for (int64_t r = 0; r < n; r++) rms_row(h + r * H, x + r * H, p[LN2], f[EPS2], H);
            PHASE(PH_ELEMENTWISE);
            product(pw, mine_a, lp, h, H, n, p[WGU], H, 2 * I, t, T);
            BARRIER(PH_PRODUCTS);
            /* SwiGLU over the down product's rows this thread reads: its share of them over [in, out] rows,
             * all of them over panels (split_mlp: this thread's share of the rows, for the team) */
            const float *bgu = p[BGU];
            const int64_t m0 = pw ? 0 : share_start(I, t, T), m1 = pw ? I : share_end(I, t, T);
            float *const mlp = split_mlp ? ms : m;
            for (int64_t r = split_mlp ? n * t / T : 0, r1 = split_mlp ? n * (t + 1) / T : n; r < r1; r++) {
                const float *pr = pa + r * lp;
                float *mr = mlp + r * I;
                if (sets == 1 && !bgu) { /* panels' whole sums, read in place (totals would copy them) */
                    for (int64_t i = m0; i < m1; i++) mr[i] = pr[i] / (1.f + expf(-pr[i])) * pr[I + i];
                    continue;
                }
                totals(mr + m0, pr, stride, sets, bgu, m0, m1 - m0, 0);
                totals(up + m0, pr, stride, sets, bgu, I + m0, m1 - m0, 0);
                /* apart from the sums, so that it vectorises (glibc's vector expf: a row's share is ~700 calls) */
                for (int64_t i = m0; i < m1; i++) mr[i] = mr[i] / (1.f + expf(-mr[i])) * up[i];
            }
            if (split_mlp)
                BARRIER(PH_ELEMENTWISE);
            else
                PHASE(PH_ELEMENTWISE);
            product(pw, mine_b, lp, mlp, I, n, p[WD], I, H, t, T);
            BARRIER(PH_PRODUCTS);
            residual(x, pb, stride, lp, n, p[BD], H, sets);
        }
        PHASE(PH_ELEMENTWISE);
        if (nlog) {
            for (int64_t j = 0; j < nlog; j++) rms_row(h + j * H, x + lrows[j] * H, norm_w, norm_eps, H);
            if (pw && !lm_b && V % dims[PANELW] == 0) { /* whole sums of whole panels: straight into the logits */
                product(pw, logits, V, h, H, nlog, lm_w, H, V, t, T);
            } else {
                product(pw, mine_a, lp, h, H, nlog, lm_w, H, V, t, T);
                BARRIER(PH_LOGITS);
                reduce(logits, V, pa, stride, lp, nlog, lm_b, V, t, T, sets);
            }
            PHASE(PH_LOGITS);
        }
        restore_denormals(fp_mode);
        if (phases)
            for (int c = 0; c < NPHASE; c++) {
                const double mean = ph[c] / T;
#pragma omp atomic
                phases[c] += mean;
            }
    }
    free(buf);
    return 0;
}
