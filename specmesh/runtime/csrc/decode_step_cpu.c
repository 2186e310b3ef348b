/* One token of one sequence through a whole Llama-family decoder on the CPU, in one call: embedding row in,
 * logits out, the new key and value written where the block table says. See cpu_kernels.py for why.
 *
 * The whole forward is one OpenMP parallel region. Every matrix-vector product splits the weights' rows over the
 * team in fixed ranges (as gemv_cpu.c: each thread streams whole [in, out] rows into a private partial sum;
 * splitting the columns instead read 20-30 % slower), and the partials are summed in thread
 * order where they are used: the attention sums its own heads' q, k and v, the MLP sums gate and up, the
 * residual adds are split by columns. A result depends on the team's size, never on timing. The small steps
 * between products (RMSNorm, SwiGLU) are recomputed by every thread into its own scratch rather than split,
 * which costs less than the barrier a split would need; a layer is seven barriers.
 *
 * Attention is split by KV head: the thread that owns a KV head applies rotary to its key and its query heads,
 * writes the key and value into the pool and attends, so nothing it reads is written by another thread. The
 * softmax is exact per row, as block_attention_cpu.c's.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { LN1, WQKV, BQKV, WO, BO, QN, KN, LN2, WGU, BGU, WD, BD, KPOOL, VPOOL, NPTR };
enum { EPS1, EPS2, SCALE, QN_EPS, KN_EPS, NFL };
enum { HID, NH, NKV, HD, INTER, VOCAB, LAYERS, BS, POS, K_SH, K_SS, V_SH, V_SS, NDIM };

static void rms(float *y, const float *x, const float *w, float eps, int64_t n) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

/* This thread's partial of x . S over its fixed range of S's rows (multiples of 8): part[0, out). Eight rows
 * per pass over the partial: one load and store of it per eight weights read (four measured ~34 GB/s over the
 * demo target's matrices on 2 threads, eight ~40). */
static void partial(float *part, const float *x, const float *S, int64_t in, int64_t out, int t, int T) {
    const int64_t octs = (in + 7) / 8;
    const int64_t i1 = t == T - 1 ? in : 8 * (octs * (t + 1) / T);
    int64_t i = 8 * (octs * t / T);
    memset(part, 0, sizeof(float) * out);
    for (; i + 8 <= i1; i += 8) {
        const float x0 = x[i], x1 = x[i + 1], x2 = x[i + 2], x3 = x[i + 3];
        const float x4 = x[i + 4], x5 = x[i + 5], x6 = x[i + 6], x7 = x[i + 7];
        const float *s0 = S + i * out, *s1 = s0 + out, *s2 = s1 + out, *s3 = s2 + out;
        const float *s4 = s3 + out, *s5 = s4 + out, *s6 = s5 + out, *s7 = s6 + out;
#pragma omp simd
        for (int64_t j = 0; j < out; j++)
            part[j] += (x0 * s0[j] + x1 * s1[j] + x2 * s2[j] + x3 * s3[j]) +
                       (x4 * s4[j] + x5 * s5[j] + x6 * s6[j] + x7 * s7[j]);
    }
    for (; i < i1; i++) {
        const float xi = x[i];
        const float *s = S + i * out;
#pragma omp simd
        for (int64_t j = 0; j < out; j++) part[j] += xi * s[j];
    }
}

/* The team's partials summed for outputs [j0, j1), in thread order, plus the bias: x . S + b there */
static inline float total(const float *parts, int64_t stride, int T, const float *b, int64_t j) {
    float v = 0.f;
    for (int u = 0; u < T; u++) v += parts[u * stride + j];
    return b ? v + b[j] : v;
}

/* y[j] (+)= x . S + b over this thread's share of the columns, once every thread's partial is written */
static void reduce(float *y, const float *parts, int64_t stride, const float *b, int64_t out, int add, int t, int T) {
    const int64_t j0 = out * t / T, j1 = out * (t + 1) / T;
    for (int64_t j = j0; j < j1; j++) y[j] = add ? y[j] + total(parts, stride, T, b, j) : total(parts, stride, T, b, j);
}

static void rope(float *x, const float *cos, const float *sin, int64_t D) {
    float tmp[512];
    const int64_t half = D / 2;
    memcpy(tmp, x, sizeof(float) * D);
    for (int64_t d = 0; d < D; d++) x[d] = tmp[d] * cos[d] + tmp[(d + half) % D] * sin[d];
}

/* The G query heads of one KV head over positions [0, end): out[g] = softmax(q[g] . K) . V */
static void attend(float *out, const float *q, const float *kb, const float *vb, const int32_t *table, int64_t end,
                   int64_t bs, int64_t ks, int64_t vs, int64_t G, int64_t D, float scale, float *qb, float *sc) {
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) qb[g * D + d] = q[g * D + d] * scale;
    for (int64_t b0 = 0; b0 < end; b0 += bs) {
        const float *kblk = kb + (int64_t)table[b0 / bs] * bs * ks;
        const int64_t nb = end - b0 < bs ? end - b0 : bs;
        for (int64_t i = 0; i < nb; i++) {
            const float *kp = kblk + i * ks;
            for (int64_t g = 0; g < G; g++) {
                const float *qr = qb + g * D;
                float a = 0.f;
#pragma omp simd reduction(+ : a)
                for (int64_t d = 0; d < D; d++) a += qr[d] * kp[d];
                sc[g * end + b0 + i] = a;
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *row = sc + g * end;
        float m = -FLT_MAX;
        for (int64_t p = 0; p < end; p++) m = row[p] > m ? row[p] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < end; p++) {
            row[p] = expf(row[p] - m);
            sum += row[p];
        }
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < end; p++) row[p] *= inv;
    }
    memset(out, 0, sizeof(float) * G * D);
    for (int64_t b0 = 0; b0 < end; b0 += bs) {
        const float *vblk = vb + (int64_t)table[b0 / bs] * bs * vs;
        const int64_t nb = end - b0 < bs ? end - b0 : bs;
        for (int64_t i = 0; i < nb; i++) {
            const float *vp = vblk + i * vs;
            for (int64_t g = 0; g < G; g++) {
                const float w = sc[g * end + b0 + i];
                float *o = out + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] += w * vp[d];
            }
        }
    }
}

/* dims: NDIM values (the enum above; strides of the KV pools in elements, head and slot). ptrs: NPTR per layer
 * (weights [in, out] with rows `out` floats apart; biases, q/k norms may be NULL; the layer's K and V pools).
 * fl: NFL per layer. x0: the token's embedding row. cos, sin: the rotary rows of its position (rotate_half's
 * sign folded into sin). table: the sequence's block table. lm_w NULL: no logits (a prefill token).
 * Returns 0, or -1 when scratch could not be allocated (then nothing was written). */
int specmesh_decode_step(const int64_t *dims, void *const *ptrs, const float *fl, const float *x0, const float *cos,
                         const float *sin, const int32_t *table, const float *norm_w, float norm_eps,
                         const float *lm_w, const float *lm_b, float *logits, int threads) {
    const int64_t H = dims[HID], nh = dims[NH], nkv = dims[NKV], D = dims[HD], I = dims[INTER], V = dims[VOCAB];
    const int64_t L = dims[LAYERS], bs = dims[BS], pos = dims[POS], G = nh / nkv, end = pos + 1;
    const int64_t nqkv = (nh + 2 * nkv) * D;
    if (D > 512 || D % 2) return -2;
    if (threads < 1) threads = 1;
    int64_t widest = nqkv > 2 * I ? nqkv : 2 * I;
    widest = widest > V ? widest : V;
    widest = ((widest > H ? widest : H) + 15) / 16 * 16;
    /* shared: x [H], attn [nh D], two sets of partials [T, widest] (a product's partials are read while the
     * next product writes the other set); per thread: h [H], m [I], q/k/v [(G + 2) D], qb [G D], sc [G end] */
    const int64_t shared = (H + nh * D + 15) / 16 * 16 + 2 * widest * threads;
    const int64_t own = (H + I + (2 * G + 2) * D + G * end + 15) / 16 * 16;
    float *buf = aligned_alloc(64, ((size_t)(shared + own * threads) * sizeof(float) + 63) / 64 * 64);
    if (!buf) return -1;
    float *x = buf, *attn = x + H, *pa = buf + (H + nh * D + 15) / 16 * 16, *pb = pa + widest * threads;
    float *priv = buf + shared;
    memcpy(x, x0, sizeof(float) * H);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        float *h = priv + (int64_t)t * own, *m = h + H, *q = m + I, *k = q + G * D, *v = k + D, *qb = v + D;
        float *sc = qb + G * D, *mine_a = pa + (int64_t)t * widest, *mine_b = pb + (int64_t)t * widest;
        for (int64_t l = 0; l < L; l++) {
            void *const *p = ptrs + l * NPTR;
            const float *f = fl + l * NFL, *bqkv = p[BQKV];
            rms(h, x, p[LN1], f[EPS1], H);
            partial(mine_a, h, p[WQKV], H, nqkv, t, T);
#pragma omp barrier
            for (int64_t kh = nkv * t / T; kh < nkv * (t + 1) / T; kh++) {
                /* this KV head's query heads, key and value, summed from the partials */
                const int64_t qo = kh * G * D, ko = (nh + kh) * D, vo = (nh + nkv + kh) * D;
                for (int64_t d = 0; d < G * D; d++) q[d] = total(pa, widest, T, bqkv, qo + d);
                for (int64_t d = 0; d < D; d++) {
                    k[d] = total(pa, widest, T, bqkv, ko + d);
                    v[d] = total(pa, widest, T, bqkv, vo + d);
                }
                for (int64_t g = 0; g < G; g++) {
                    if (p[QN]) rms(q + g * D, q + g * D, p[QN], f[QN_EPS], D);
                    rope(q + g * D, cos, sin, D);
                }
                if (p[KN]) rms(k, k, p[KN], f[KN_EPS], D);
                rope(k, cos, sin, D);
                float *kb = (float *)p[KPOOL] + kh * dims[K_SH], *vb = (float *)p[VPOOL] + kh * dims[V_SH];
                const int64_t slot = (int64_t)table[pos / bs] * bs + pos % bs;
                memcpy(kb + slot * dims[K_SS], k, sizeof(float) * D);
                memcpy(vb + slot * dims[V_SS], v, sizeof(float) * D);
                attend(attn + qo, q, kb, vb, table, end, bs, dims[K_SS], dims[V_SS], G, D, f[SCALE], qb, sc);
            }
#pragma omp barrier
            partial(mine_b, attn, p[WO], nh * D, H, t, T);
#pragma omp barrier
            reduce(x, pb, widest, p[BO], H, 1, t, T);
#pragma omp barrier
            rms(h, x, p[LN2], f[EPS2], H);
            partial(mine_a, h, p[WGU], H, 2 * I, t, T);
#pragma omp barrier
            const float *bgu = p[BGU];
            for (int64_t i = 0; i < I; i++) {
                const float g = total(pa, widest, T, bgu, i), u = total(pa, widest, T, bgu, I + i);
                m[i] = g / (1.f + expf(-g)) * u;
            }
            partial(mine_b, m, p[WD], I, H, t, T);
#pragma omp barrier
            reduce(x, pb, widest, p[BD], H, 1, t, T);
#pragma omp barrier
        }
        if (lm_w) {
            rms(h, x, norm_w, norm_eps, H);
            partial(mine_a, h, lm_w, H, V, t, T);
#pragma omp barrier
            reduce(logits, pa, widest, lm_b, V, 0, t, T);
        }
    }
    free(buf);
    return 0;
}
