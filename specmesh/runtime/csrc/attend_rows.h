/* The attention core both CPU kernels share (block_attention_cpu.c, decode_step_cpu.c): rows r = t G + g, token t
 * of n at position start + t and query head g of a KV head's G, attend over the KV head's keys and values at
 * positions [0, start + t] where the block table says they lie. A row's softmax is exact over its visible keys
 * (max, exp, sum: no running rescale, the scores fit in a scratch row). A row's result depends on its own query
 * and keys only, never on the other rows of the call: a verify block's rows and one-token steps at the same
 * positions get the same bits.
 *
 * For a head size of whole 16-float vectors (the common ones) a row's scores are taken sixteen keys at a time
 * (the lanes of each key's products summed in one fixed tree for all sixteen: a horizontal sum per key cost more
 * than the products), and two rows at a time accumulate their values in registers. Otherwise key by key. The
 * next unit's keys and values are fetched while a unit takes its scores (next_unit): on a batch's cold KV,
 * reading on demand ran at a third of the memory's bandwidth.
 *
 * Masked keys are skipped, never set to -inf, so the code stays finite and may be built with -ffast-math (for
 * glibc's vectorised expf). Inlined into each caller, so a head size the caller passes as a constant unrolls.
 */
#ifndef SPECMESH_ATTEND_ROWS_H
#define SPECMESH_ATTEND_ROWS_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The KV pools' element: float, or (built with SPECMESH_KV_BF16, `--kv-cache-dtype bfloat16`) bfloat16, which
 * halves the bytes attention reads (at a batch's long contexts it is bound by that read). A bfloat16 key or value
 * widens to float exactly on load, and everything after it is float32 arithmetic, the same as for a float pool;
 * a float is narrowed once, when written, rounding to nearest even as torch's `.to(torch.bfloat16)` does, so the
 * C kernels and the torch path write the same bits. KV_NAME gives each exported entry its own name per build. */
#ifdef SPECMESH_KV_BF16
typedef uint16_t kv_t;
#define KV_NAME(f) f##_bf16
static inline __attribute__((always_inline)) float kvf(kv_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
/* Rounded to nearest even as torch's tensor conversion rounds (its NaN: 0xffff), in integers (-ffast-math may
 * assume no NaN in float tests) */
static inline __attribute__((always_inline)) kv_t kv_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (kv_t)0xffff;
    return (kv_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#else
typedef float kv_t;
#define KV_NAME(f) f
static inline __attribute__((always_inline)) float kvf(kv_t x) { return x; }
#endif

/* Denormals flushed to zero and read as zero (the SSE control register's FTZ and DAZ) on the calling thread
 * while a kernel runs, its mode given back after. A softmax's weights for keys far below a row's largest score
 * underflow into denormals, and every multiply-add of the values that meets one took a microcode assist: an
 * executable built with -ffast-math sets this mode at start-up (crtfastmath.o), a shared library inside Python
 * does not. In the fused step (interleaved, in one process): attention 8-20 % faster, a 16 x 5 batch 3 %, 16 x 1
 * at 560 cached tokens 2-3 %, its logits equal to the bit. Every row of every call runs in this mode, so a
 * verify block's rows still equal the steps'. */
#if defined(__SSE__)
#include <xmmintrin.h>
static inline unsigned flush_denormals(void) {
    const unsigned mode = _mm_getcsr();
    _mm_setcsr(mode | 0x8040);
    return mode;
}
static inline void restore_denormals(unsigned mode) { _mm_setcsr(mode); }
#else
static inline unsigned flush_denormals(void) { return 0; }
static inline void restore_denormals(unsigned mode) { (void)mode; }
#endif

/* dst[0, D) = src[0, D) in the pools' element */
static inline __attribute__((always_inline)) void kv_put(kv_t *dst, const float *src, int64_t D) {
#ifdef SPECMESH_KV_BF16
    for (int64_t d = 0; d < D; d++) dst[d] = kv_of(src[d]);
#else
    memcpy(dst, src, sizeof(float) * D);
#endif
}

/* The softmax of each row over its visible scores, in place */
static inline __attribute__((always_inline)) void softmax_rows(float *sc, int64_t R, int64_t G, int64_t start,
                                                               int64_t stride) {
    for (int64_t r = 0; r < R; r++) {
        float *row = sc + r * stride;
        const int64_t vis = start + r / G + 1;
        float m = -FLT_MAX;
        for (int64_t p = 0; p < vis; p++) m = row[p] > m ? row[p] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < vis; p++) {
            row[p] = expf(row[p] - m);
            sum += row[p];
        }
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < vis; p++) row[p] *= inv;
    }
}

/* The unit (sequence, KV head) the caller runs next: its keys and values, block table and length, fetched into
 * the cache block by block while this one computes its scores. A block is a run of pages of its own, where the
 * hardware's prefetchers stop and start over, so a unit read on demand waits on memory's latency block after
 * block; and fetched all at once ahead of a unit, the requests filled the core's miss queue and the fetching
 * waited for memory before the computing began (a cold 16 x 5 batch's attention took its compute time plus its
 * KV's read time). Spread over the scores' blocks, the two overlap. Where a block's keys (and values) are one
 * contiguous run of at least a page, as the paged pools lay them out in float32, one line in every KiB is touched
 * and the hardware's streamer takes the rest of the page: a line at a time, the prefetches themselves were a
 * sixth of a cached unit's time (interleaved A/B in one process, the demo target: 16 x 1 at 560 cached tokens
 * -5 %, 16 x 9 -2 %, 4 x 5 at 300 -3 %, 16 x 5 at 128 within 1 %). A shorter run (a block of bfloat16 keys is
 * half a page, and the streamer runs on into the next block's, another unit's) measured 2-5 % slower touched
 * sparsely, so it, and keys apart from each other, are fetched a line at a time. */
typedef struct {
    const kv_t *k, *v;
    const int32_t *table;
    int64_t end;
} next_unit;

static inline __attribute__((always_inline)) void prefetch_block(const next_unit *nx, int64_t b0, int64_t bs,
                                                                 int64_t ks, int64_t vs, const int64_t D) {
    if (!nx || b0 >= nx->end) return;
    const int64_t blk = nx->table[b0 / bs], nb = nx->end - b0 < bs ? nx->end - b0 : bs;
    const kv_t *kp = nx->k + blk * bs * ks, *vp = nx->v + blk * bs * vs;
    if (ks == D && vs == D && bs * D * (int64_t)sizeof(kv_t) >= 4096) {
        const int64_t kib = 1024 / (int64_t)sizeof(kv_t); /* elements */
        for (int64_t e = 0; e < nb * D; e += kib) {
            __builtin_prefetch(kp + e, 0, 2);
            __builtin_prefetch(vp + e, 0, 2);
        }
        return;
    }
    for (int64_t i = 0; i < nb; i++)
        for (int64_t d = 0; d < D; d += 64 / (int64_t)sizeof(kv_t)) { /* a line at a time */
            __builtin_prefetch(kp + i * ks + d, 0, 2);
            __builtin_prefetch(vp + i * vs + d, 0, 2);
        }
}

/* The next unit's blocks from b0 on (those past this unit's own) */
static inline __attribute__((always_inline)) void prefetch_rest(const next_unit *nx, int64_t b0, int64_t bs,
                                                                int64_t ks, int64_t vs, const int64_t D) {
    for (; nx && b0 < nx->end; b0 += bs) prefetch_block(nx, b0, bs, ks, vs, D);
}

/* A unit of several rows (a verify block's: SPREAD_ROWS tokens or more of one sequence) computes long enough
 * per block to fetch every line itself, spread over the whole unit: its own values while it scores (they are
 * read once the scores are done), the next unit's keys while it sums values. Interleaved A/B in one process, the
 * demo target: 16 x 5 at 128 cached tokens -2 %, at 560 -3-3.5 % (bfloat16 pools -3.6 %), 16 x 9 at 560 -2 %. A
 * one-token unit keeps prefetch_block's schedule, which reads at the memory's rate (16 x 1 at 512: the same
 * either way).
 * The lines go out one per key's product (line_run: a key's scores, a key's values), not a block's worth at once:
 * a core holds ~16 misses, and a burst of a block's 64 prefetches stalled it until they drained (perf: two fifths
 * of attention's samples on the prefetch instructions), so the fetching and the arithmetic took turns; a line at
 * a time they overlap. Scoring block b fetches block b + 1's values (block 0's go at the unit's start), summing
 * values fetches the next unit's keys. Interleaved A/B in one process, the demo target: attention 16 x 5 at 128
 * cached tokens -16-20 %, at 512 -20-23 %, 16 x 8 at 512 -22 %, 1 x 6 at 600 -18 % (the forward -3-11 %). So
 * scheduled, two- and three-token units gain too, where the bursts had cost them what they hid: attention 16 x 2
 * at 128 -17 %, at 512 -20 %, 16 x 3 at 256 -31 %, at 512 -25 %, 4 x 2 at 512 -10 %, 1 x 3 at 600 -9 %. */
enum { SPREAD_ROWS = 2 };

/* Every line of block b0's run of one head's keys or values (st: a slot's stride), up to position end */
static inline __attribute__((always_inline)) void prefetch_lines(const kv_t *head, const int32_t *table, int64_t end,
                                                                 int64_t b0, int64_t bs, int64_t st, const int64_t D) {
    if (b0 >= end) return;
    const int64_t nb = end - b0 < bs ? end - b0 : bs;
    const kv_t *p = head + (int64_t)table[b0 / bs] * bs * st;
    if (st == D) {
        for (int64_t e = 0; e < nb * D; e += 64 / (int64_t)sizeof(kv_t)) __builtin_prefetch(p + e, 0, 2);
        return;
    }
    for (int64_t i = 0; i < nb; i++)
        for (int64_t d = 0; d < D; d += 64 / (int64_t)sizeof(kv_t)) __builtin_prefetch(p + i * st + d, 0, 2);
}

/* Block b0's run of one head's keys or values (st: a slot's stride, up to position end) as lines to fetch one at
 * a time between the arithmetic (run_step), where the run is contiguous; a run with gaps is fetched at once
 * (prefetch_lines) and leaves nothing to step. */
typedef struct {
    const char *p;
    int64_t left;
} line_run;

static inline __attribute__((always_inline)) line_run run_of(const kv_t *head, const int32_t *table, int64_t end,
                                                             int64_t b0, int64_t bs, int64_t st, const int64_t D) {
    if (b0 >= end) return (line_run){NULL, 0};
    if (st != D) {
        prefetch_lines(head, table, end, b0, bs, st, D);
        return (line_run){NULL, 0};
    }
    const int64_t nb = end - b0 < bs ? end - b0 : bs;
    return (line_run){(const char *)(head + (int64_t)table[b0 / bs] * bs * st),
                      (nb * D * (int64_t)sizeof(kv_t) + 63) / 64};
}

static inline __attribute__((always_inline)) void run_step(line_run *r) {
    if (r->left > 0) {
        __builtin_prefetch(r->p, 0, 2);
        r->p += 64;
        r->left--;
    }
}

static inline __attribute__((always_inline)) void run_rest(line_run *r) {
    while (r->left > 0) run_step(r);
}

/* acc [n G, D] = softmax(qb . K) . V for the rows above, for any head size, key by key */
static inline __attribute__((always_inline)) void attend_rows_any(float *acc, const float *qb, const kv_t *kb,
                                                                  const kv_t *vb, const int32_t *table,
                                                                  int64_t start, int64_t n, int64_t G, const int64_t D,
                                                                  int64_t bs, int64_t ks, int64_t vs, float *sc,
                                                                  int64_t stride, const next_unit *nx) {
    const int64_t R = n * G, end = start + n;
    /* scores, block by block (a block's keys are consecutive slots: no division per key) */
    int64_t b0 = 0;
    for (; b0 < end; b0 += bs) {
        prefetch_block(nx, b0, bs, ks, vs, D);
        const kv_t *kblk = kb + (int64_t)table[b0 / bs] * bs * ks;
        const int64_t nb = end - b0 < bs ? end - b0 : bs;
        for (int64_t i = 0; i < nb; i++) {
            const int64_t p = b0 + i;
            const kv_t *kp = kblk + i * ks;
            for (int64_t r = (p > start ? p - start : 0) * G; r < R; r++) { /* the rows that see position p */
                const float *qr = qb + r * D;
                float a = 0.f;
#pragma omp simd reduction(+ : a)
                for (int64_t d = 0; d < D; d++) a += qr[d] * kvf(kp[d]);
                sc[r * stride + p] = a;
            }
        }
    }
    prefetch_rest(nx, b0, bs, ks, vs, D);
    softmax_rows(sc, R, G, start, stride);
    memset(acc, 0, sizeof(float) * R * D);
    for (int64_t b0 = 0; b0 < end; b0 += bs) {
        const kv_t *vblk = vb + (int64_t)table[b0 / bs] * bs * vs;
        const int64_t nb = end - b0 < bs ? end - b0 : bs;
        for (int64_t i = 0; i < nb; i++) {
            const int64_t p = b0 + i;
            const kv_t *vp = vblk + i * vs;
            for (int64_t r = (p > start ? p - start : 0) * G; r < R; r++) {
                const float w = sc[r * stride + p];
                float *o = acc + r * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] += w * kvf(vp[d]);
            }
        }
    }
}

/* The vectors the core computes in: VW lanes, sixteen floats with AVX-512 (one register), eight otherwise (one AVX
 * register, two SSE ones on a CPU without AVX). At sixteen lanes without AVX-512 every vector was two registers,
 * the key-group sums' shuffles across them went element by element through the stack, and the arrays of sixteen
 * spilled: a 16 x 5 batch's attention at 128 cached tokens took 2.3 ms a layer on an AVX2 host, ten times its
 * arithmetic. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
/* x held in a register from here on: a pair's value vector loaded once for both rows (folded into each
 * multiply-add it was loaded twice, and the loop ran at the load ports: cached KV, 16 x 5, attention -5 %).
 * Where a vf is one AVX-512 register; elsewhere nothing. */
#if defined(__AVX512F__)
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define IN_REGISTER(x) ((void)0)
#endif
/* Values two rows at a time where the pair's sums fit in registers (32 of them with AVX-512); with 16, a pair's
 * sums at a head of 64 spilled */
#if defined(__AVX512F__)
#define PAIRS 1
#else
#define PAIRS 0
#endif

static inline __attribute__((always_inline)) vf ldv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* VW of the pools' elements as floats (exact) */
static inline __attribute__((always_inline)) vf ldkv(const kv_t *p) {
#ifdef SPECMESH_KV_BF16
#if defined(__AVX512F__)
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#elif defined(__AVX2__)
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#else
    vf v;
    for (int l = 0; l < VW; l++) v[l] = kvf(p[l]);
    return v;
#endif
#else
    return ldv(p);
#endif
}

/* q . k lane by lane: lane l holds the sum over the row's vectors c of q[c][l] k[VW c + l] */
static inline __attribute__((always_inline)) vf dot_lanes(const vf *q, const kv_t *k, const int64_t VN) {
    vf s = q[0] * ldkv(k);
#pragma GCC unroll 32
    for (int64_t c = 1; c < VN; c++) s += q[c] * ldkv(k + VW * c);
    return s;
}

/* s[j] = the sum of a[j]'s VW lanes, for j < VW: rounds of halving, each adding the two halves of a pair of
 * vectors (x's lanes beside y's), so no lane of one key ever meets another key's. The order of a key's sums
 * depends only on its own lanes: whatever the other lanes hold (zeros for an absent key), it is the same. */
#if VW == 16
static inline __attribute__((always_inline)) vf sum_keys(vf a[VW]) {
    const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const vi hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const vi lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const vi hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const vi lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const vi hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    vf b[8], c[4], d[2];
    for (int j = 0; j < 8; j++) b[j] = __builtin_shuffle(a[j], a[j + 8], lo8) + __builtin_shuffle(a[j], a[j + 8], hi8);
    /* b[j]: lanes 0-7 key j, 8-15 key j + 8 */
    for (int j = 0; j < 4; j++) c[j] = __builtin_shuffle(b[j], b[j + 4], lo4) + __builtin_shuffle(b[j], b[j + 4], hi4);
    /* c[j]: lanes by fours, keys j, j + 4, j + 8, j + 12 */
    for (int j = 0; j < 2; j++) d[j] = __builtin_shuffle(c[j], c[j + 2], lo2) + __builtin_shuffle(c[j], c[j + 2], hi2);
    /* d[j]: lanes by twos, keys j, j + 2, ..., j + 14 */
    return __builtin_shuffle(d[0], d[1], lo1) + __builtin_shuffle(d[0], d[1], hi1);
}
#else
static inline __attribute__((always_inline)) vf sum_keys(vf a[VW]) {
    const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    const vi lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const vi lo1 = {0, 8, 2, 10, 4, 12, 6, 14}, hi1 = {1, 9, 3, 11, 5, 13, 7, 15};
    vf c[4], d[2];
    for (int j = 0; j < 4; j++) c[j] = __builtin_shuffle(a[j], a[j + 4], lo4) + __builtin_shuffle(a[j], a[j + 4], hi4);
    /* c[j]: lanes 0-3 key j, 4-7 key j + 4 */
    for (int j = 0; j < 2; j++) d[j] = __builtin_shuffle(c[j], c[j + 2], lo2) + __builtin_shuffle(c[j], c[j + 2], hi2);
    /* d[j]: lanes by twos, keys j, j + 2, j + 4, j + 6 */
    return __builtin_shuffle(d[0], d[1], lo1) + __builtin_shuffle(d[0], d[1], hi1);
}
#endif

/* attend_rows_any's result for a head size of whole vectors (a constant, so the rows' vectors stay in
 * registers). Scores: a row against up to sixteen keys of a block at once, each key's lanes summed by sum16; a
 * group's keys past the sequence's end are not read. Values: two rows at a time over their visible keys in
 * order, each row's sum kept in registers (the same sequence of multiply-adds for a row whatever its partner). */
static inline __attribute__((always_inline)) void attend_rows_vec(float *acc, const float *qb, const kv_t *kb,
                                                                  const kv_t *vb, const int32_t *table,
                                                                  int64_t start, int64_t n, int64_t G, const int64_t D,
                                                                  int64_t bs, int64_t ks, int64_t vs, float *sc,
                                                                  int64_t stride, const next_unit *nx) {
    enum { MAXV = 256 / VW };
    const int64_t R = n * G, end = start + n, VN = D / VW;
    const int spread = n >= SPREAD_ROWS;
    int64_t b0 = 0;
    for (; b0 < end; b0 += bs) {
        line_run vrun = {NULL, 0};
        if (spread && b0 == 0) {
            line_run first = run_of(vb, table, end, 0, bs, vs, D);
            run_rest(&first);
        }
        if (spread)
            vrun = run_of(vb, table, end, b0 + bs, bs, vs, D);
        else
            prefetch_block(nx, b0, bs, ks, vs, D);
        const kv_t *kblk = kb + (int64_t)table[b0 / bs] * bs * ks;
        const int64_t nb = end - b0 < bs ? end - b0 : bs;
        for (int64_t i0 = 0; i0 < nb; i0 += VW) {
            const int64_t cnt = nb - i0 < VW ? nb - i0 : VW, p0 = b0 + i0;
            /* every row that sees the group's first key takes all of the group's keys (scores past a row's own
             * position are written but never read) */
            for (int64_t r = (p0 > start ? p0 - start : 0) * G; r < R; r++) {
                vf q[MAXV], a[VW];
#pragma GCC unroll 32
                for (int64_t c = 0; c < VN; c++) q[c] = ldv(qb + r * D + VW * c);
#pragma GCC unroll 16
                for (int64_t j = 0; j < VW; j++) {
                    a[j] = j < cnt ? dot_lanes(q, kblk + (i0 + j) * ks, VN) : (vf){0};
                    run_step(&vrun);
                }
                const vf t = sum_keys(a);
                if (cnt == VW) /* a whole vector's store; a copy of a variable length took a slow string move */
                    memcpy(sc + r * stride + p0, &t, sizeof t);
                else
                    for (int64_t j = 0; j < cnt; j++) sc[r * stride + p0 + j] = t[j];
            }
        }
        run_rest(&vrun);
    }
    if (!spread) prefetch_rest(nx, b0, bs, ks, vs, D);
    softmax_rows(sc, R, G, start, stride);
    /* Values a block of keys at a time, for every pair of rows that sees the block: the block's values are
     * read from memory once and from the L1 for each further pair (pair by pair over all the keys, each pair
     * read them again from the L2, and at 9 rows of 560 keys that bounded the loop). A pair's sums stay in
     * registers within a block and in acc between blocks, so each row's sum is the same sequence of
     * multiply-adds over its keys in order as a whole pass would make. */
    for (int64_t b0 = 0; b0 < end; b0 += bs) {
        line_run krun = spread && nx ? run_of(nx->k, nx->table, nx->end, b0, bs, ks, D) : (line_run){NULL, 0};
        const kv_t *vblk = vb + (int64_t)table[b0 / bs] * bs * vs;
        const int64_t bend = end - b0 < bs ? end : b0 + bs;
        for (int64_t r = (b0 > start ? b0 - start : 0) * G; r < R; r += PAIRS ? 2 : 1) {
            const int64_t two = PAIRS && r + 1 < R, visa = start + r / G + 1, visb = two ? start + (r + 1) / G + 1 : 0;
            const float *wa = sc + r * stride, *wb = sc + (r + 1) * stride;
            float *ra = acc + r * D, *rb = acc + (r + 1) * D;
            vf oa[MAXV], ob[MAXV];
#pragma GCC unroll 32
            for (int64_t c = 0; c < VN; c++) {
                oa[c] = b0 ? ldv(ra + VW * c) : (vf){0};
                ob[c] = b0 && two ? ldv(rb + VW * c) : (vf){0};
            }
            /* a row without a partner (the last of an odd count; every row of a one-token step) has a loop of
             * its own: through the pairs' second loop it tested both rows' visibility at every vector */
            const int64_t both = two ? (visb < visa ? visb : visa) : b0;
            int64_t p = b0;
            for (; !two && p < bend && p < visa; p++) {
                run_step(&krun);
                const kv_t *vp = vblk + (p - b0) * vs;
#pragma GCC unroll 32
                for (int64_t c = 0; c < VN; c++) oa[c] += wa[p] * ldkv(vp + VW * c);
            }
            for (; p < both && p < bend; p++) {
                run_step(&krun);
                const kv_t *vp = vblk + (p - b0) * vs;
#pragma GCC unroll 32
                for (int64_t c = 0; c < VN; c++) {
                    vf x = ldkv(vp + VW * c);
                    IN_REGISTER(x);
                    oa[c] += wa[p] * x;
                    ob[c] += wb[p] * x;
                }
            }
            for (; p < bend && (p < visa || p < visb); p++) {
                const kv_t *vp = vblk + (p - b0) * vs;
#pragma GCC unroll 32
                for (int64_t c = 0; c < VN; c++) {
                    const vf x = ldkv(vp + VW * c);
                    if (p < visa) oa[c] += wa[p] * x;
                    if (p < visb) ob[c] += wb[p] * x;
                }
            }
#pragma GCC unroll 32
            for (int64_t c = 0; c < VN; c++) memcpy(ra + VW * c, &oa[c], sizeof(vf));
            if (two)
#pragma GCC unroll 32
                for (int64_t c = 0; c < VN; c++) memcpy(rb + VW * c, &ob[c], sizeof(vf));
        }
        run_rest(&krun);
    }
    for (int64_t b = (end + bs - 1) / bs * bs; spread && nx && b < nx->end; b += bs) /* its keys past this one's */
        prefetch_lines(nx->k, nx->table, nx->end, b, bs, ks, D);
}

/* acc [n G, D] = softmax(qb . K) . V for the rows above; qb: [n G, D], scaled (and rotated). kb, vb: the KV
 * head's keys and values (slot s at kb + s * ks); sc: scratch [n G, stride], stride >= start + n; nx: the unit
 * the caller runs next, or NULL. */
static inline __attribute__((always_inline)) void attend_rows(float *acc, const float *qb, const kv_t *kb,
                                                              const kv_t *vb, const int32_t *table, int64_t start,
                                                              int64_t n, int64_t G, const int64_t D, int64_t bs,
                                                              int64_t ks, int64_t vs, float *sc, int64_t stride,
                                                              const next_unit *nx) {
    if (D % VW == 0 && D <= 256)
        attend_rows_vec(acc, qb, kb, vb, table, start, n, G, D, bs, ks, vs, sc, stride, nx);
    else
        attend_rows_any(acc, qb, kb, vb, table, start, n, G, D, bs, ks, vs, sc, stride, nx);
}

#endif
