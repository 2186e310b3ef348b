/* Block-table attention on the CPU: every short sequence of a ragged batch (a decode step, a verify block)
 * attends over its KV where the block pool holds it, in one call per layer. The CPU twin of
 * block_attention.py's Triton kernel, with the same layout and inputs; see cpu_kernels.py.
 *
 * Per (sequence, KV head), the unit of work: the rows are the sequence's new tokens x the query heads sharing
 * that KV head (GQA folded, so each key is read once per group), each at its token's position, attending as
 * attend_rows.h says. A row's result depends on its own query and keys only, never on the batch around it or
 * on how the units are split over threads. Built twice, over float and over bfloat16 pools (attend_rows.h).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attend_rows.h"

typedef struct {
    float *out;               /* [T, nh, D] strided */
    const float *q;           /* [T, nh, D] strided */
    const kv_t *k, *v;        /* [n_kv, slots, D] strided */
    const int32_t *tables;    /* [S, W] block ids */
    const int64_t *segs;      /* [S, 3]: first batch row, new tokens, first new position */
    int64_t W, nkv, group, D, bs;
    int64_t so_t, so_h, sq_t, sq_h, sk_h, sk_s, sv_h, sv_s;
    float scale;
    const int64_t *units;     /* unit = sequence * n_kv + KV head */
    int64_t u0, u1;           /* this worker's units [u0, u1) */
    int rc;
    /* rotary fused in (specmesh_block_attention_rope): the new keys and values, strided as q, un-rotated
     * queries and keys, and the rotary rows [position, D] (rotate_half's sign folded into sin); else NULL */
    const float *kn, *vn, *cos, *sin;
} job_t;

/* y = x * cos + rotate_half(x) * sin, rotate_half's sign folded into sin; y and x do not overlap */
static inline __attribute__((always_inline)) void rotate(float *y, const float *x, const float *c, const float *s,
                                                         float scale, const int64_t D) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < half; d++) y[d] = (x[d] * c[d] + x[d + half] * s[d]) * scale;
    for (int64_t d = half; d < D; d++) y[d] = (x[d] * c[d] + x[d - half] * s[d]) * scale;
}

static inline __attribute__((always_inline)) void unit_d(const job_t *j, int64_t s, int64_t h, float *qb,
                                                         float *acc, float *sc, int64_t stride,
                                                         const next_unit *nx, const int64_t D) {
    const int64_t off = j->segs[3 * s], n = j->segs[3 * s + 1], start = j->segs[3 * s + 2];
    const int64_t G = j->group, bs = j->bs;
    const int32_t *table = j->tables + s * j->W;
    const kv_t *kb = j->k + h * j->sk_h, *vb = j->v + h * j->sv_h;
    if (j->cos) /* this KV head's new keys (rotated) and values into their slots: only this unit writes them */
        for (int64_t t = 0; t < n; t++) {
            const int64_t p = start + t, slot = (int64_t)table[p / bs] * bs + p % bs;
            const float *ks = j->kn + (off + t) * j->sq_t + h * j->sq_h;
            float kr[512];
            rotate(kr, ks, j->cos + p * D, j->sin + p * D, 1.f, D);
            kv_put((kv_t *)kb + slot * j->sk_s, kr, D);
            kv_put((kv_t *)vb + slot * j->sv_s, j->vn + (off + t) * j->sq_t + h * j->sq_h, D);
        }
    /* the rows' queries, scaled (and rotated), packed contiguously: they stay in L1 while the keys stream past */
    for (int64_t t = 0; t < n; t++)
        for (int64_t g = 0; g < G; g++) {
            const float *src = j->q + (off + t) * j->sq_t + (h * G + g) * j->sq_h;
            float *dst = qb + (t * G + g) * D;
            if (j->cos)
                rotate(dst, src, j->cos + (start + t) * D, j->sin + (start + t) * D, j->scale, D);
            else
                for (int64_t d = 0; d < D; d++) dst[d] = src[d] * j->scale;
        }
    attend_rows(acc, qb, kb, vb, table, start, n, G, D, bs, j->sk_s, j->sv_s, sc, stride, nx);
    for (int64_t t = 0; t < n; t++)
        for (int64_t g = 0; g < G; g++)
            memcpy(j->out + (off + t) * j->so_t + (h * G + g) * j->so_h, acc + (t * G + g) * D, sizeof(float) * D);
}

/* The common head sizes as constants, so the compiler unrolls the dot and the update completely. */
static void unit(const job_t *j, int64_t s, int64_t h, float *qb, float *acc, float *sc, int64_t stride,
                 const next_unit *nx) {
    if (j->D == 64)
        unit_d(j, s, h, qb, acc, sc, stride, nx, 64);
    else if (j->D == 128)
        unit_d(j, s, h, qb, acc, sc, stride, nx, 128);
    else
        unit_d(j, s, h, qb, acc, sc, stride, nx, j->D);
}

static void work(job_t *j) {
    int64_t max_r = 1, max_end = 1;
    for (int64_t i = j->u0; i < j->u1; i++) {
        const int64_t s = j->units[i] / j->nkv, n = j->segs[3 * s + 1];
        const int64_t r = n * j->group, e = n + j->segs[3 * s + 2];
        max_r = r > max_r ? r : max_r;
        max_end = e > max_end ? e : max_end;
    }
    /* queries and accumulators [rows, D], then the scores [rows, max_end] */
    const size_t floats = (size_t)(2 * max_r * j->D + max_r * max_end);
    float *buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    if (!buf) {
        j->rc = -1;
        return;
    }
    float *qb = buf, *acc = buf + max_r * j->D, *sc = acc + max_r * j->D;
    for (int64_t i = j->u0; i < j->u1; i++) {
        next_unit nx = {NULL, NULL, NULL, 0};
        if (i + 1 < j->u1) { /* the next unit's keys and values on their way while this one computes */
            const int64_t s = j->units[i + 1] / j->nkv, h = j->units[i + 1] % j->nkv;
            nx = (next_unit){j->k + h * j->sk_h, j->v + h * j->sv_h, j->tables + s * j->W,
                             j->segs[3 * s + 2] + j->segs[3 * s + 1]};
        }
        unit(j, j->units[i] / j->nkv, j->units[i] % j->nkv, qb, acc, sc, max_end, i + 1 < j->u1 ? &nx : NULL);
    }
    free(buf);
}

static int run(const job_t *proto, const int64_t *bounds, int shares) {
    int rc = 0;
    if (shares < 1) shares = 1;
#pragma omp parallel for schedule(static, 1) num_threads(shares) reduction(| : rc) if (shares > 1)
    for (int i = 0; i < shares; i++) {
        job_t j = *proto;
        j.u0 = bounds[i];
        j.u1 = bounds[i + 1];
        const unsigned fp_mode = flush_denormals(); /* torch's threads: their mode given back */
        work(&j);
        restore_denormals(fp_mode);
        rc |= j.rc;
    }
    return rc;
}

/* strides: out (token, head), q (token, head), k (KV head, slot), v (KV head, slot), in elements; the last
 * dimension of each is contiguous. bounds: [shares + 1] split points into units, one share per thread of
 * an OpenMP team (torch's own: the library links the libgomp torch has loaded, so the team is the one whose
 * threads are still spinning after the last matmul, not new threads fighting them for the cores). Returns
 * 0, or -1 when a worker could not allocate its scratch (nothing is then guaranteed about out). */
int KV_NAME(specmesh_block_attention)(float *out, const float *q, const kv_t *k, const kv_t *v, const int32_t *tables,
                             const int64_t *segs, int64_t W, int64_t nkv, int64_t group, int64_t D, int64_t bs,
                             const int64_t *strides, float scale, const int64_t *units, const int64_t *bounds,
                             int shares) {
    const job_t j = {out, q, k, v, tables, segs, W, nkv, group, D, bs,
                     strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], strides[6], strides[7],
                     scale, units, 0, 0, 0, NULL, NULL, NULL, NULL};
    return run(&j, bounds, shares);
}

/* The same over a projection's output qkv [T, nkv * group + 2 nkv, D] (queries, then keys, then values; strides
 * (token, head) in place of q's): rotary applied to the queries and the new keys on the way in, the new keys and
 * values written into their slots (k and v are written), then attention as above. cos, sin: [positions, D]. */
int KV_NAME(specmesh_block_attention_rope)(float *out, const float *qkv, kv_t *k, kv_t *v, const int32_t *tables,
                                  const int64_t *segs, int64_t W, int64_t nkv, int64_t group, int64_t D, int64_t bs,
                                  const int64_t *strides, float scale, const int64_t *units, const int64_t *bounds,
                                  int shares, const float *cos, const float *sin) {
    const int64_t nh = nkv * group;
    const job_t j = {out, qkv, k, v, tables, segs, W, nkv, group, D, bs,
                     strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], strides[6], strides[7],
                     scale, units, 0, 0, 0, qkv + nh * strides[3], qkv + (nh + nkv) * strides[3], cos, sin};
    return run(&j, bounds, shares);
}
