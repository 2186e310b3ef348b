/* The attention core both CPU kernels share (block_attention_cpu.c, decode_step_cpu.c): rows r = t G + g, token t
 * of n at position start + t and query head g of a KV head's G, attend over the KV head's keys and values at
 * positions [0, start + t] where the block table says they lie. Scores are taken key by key (each key read once,
 * dotted with every row that sees it), a row's softmax is exact over its visible keys (max, exp, sum: no
 * running rescale, the scores fit in a scratch row), and the values are read once and accumulated into every
 * row. A row's result depends on its own query and keys only.
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

/* acc [n G, D] = softmax(qb . K) . V for the rows above; qb: [n G, D], scaled (and rotated). kb, vb: the KV
 * head's keys and values (slot s at kb + s * ks); sc: scratch [n G, stride], stride >= start + n. */
static inline __attribute__((always_inline)) void attend_rows(float *acc, const float *qb, const float *kb,
                                                              const float *vb, const int32_t *table, int64_t start,
                                                              int64_t n, int64_t G, const int64_t D, int64_t bs,
                                                              int64_t ks, int64_t vs, float *sc, int64_t stride) {
    const int64_t R = n * G, end = start + n;
    /* scores, block by block (a block's keys are consecutive slots: no division per key) */
    for (int64_t b0 = 0; b0 < end; b0 += bs) {
        const float *kblk = kb + (int64_t)table[b0 / bs] * bs * ks;
        const int64_t nb = end - b0 < bs ? end - b0 : bs;
        for (int64_t i = 0; i < nb; i++) {
            const int64_t p = b0 + i;
            const float *kp = kblk + i * ks;
            for (int64_t r = (p > start ? p - start : 0) * G; r < R; r++) { /* the rows that see position p */
                const float *qr = qb + r * D;
                float a = 0.f;
#pragma omp simd reduction(+ : a)
                for (int64_t d = 0; d < D; d++) a += qr[d] * kp[d];
                sc[r * stride + p] = a;
            }
        }
    }
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
    memset(acc, 0, sizeof(float) * R * D);
    for (int64_t b0 = 0; b0 < end; b0 += bs) {
        const float *vblk = vb + (int64_t)table[b0 / bs] * bs * vs;
        const int64_t nb = end - b0 < bs ? end - b0 : bs;
        for (int64_t i = 0; i < nb; i++) {
            const int64_t p = b0 + i;
            const float *vp = vblk + i * vs;
            for (int64_t r = (p > start ? p - start : 0) * G; r < R; r++) {
                const float w = sc[r * stride + p];
                float *o = acc + r * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] += w * vp[d];
            }
        }
    }
}

#endif
