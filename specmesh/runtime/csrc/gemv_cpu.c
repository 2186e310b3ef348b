/* One row through a linear layer on the CPU: y[out] = x[in] . S[in, out] + b, the weights stored [in, out]
 * (rows of S contiguous), as the decoders keep them for MKL. See cpu_kernels.py for why.
 *
 * The rows of S are split over the team in equal, fixed ranges (multiples of 8 rows), each thread streaming
 * its rows into a private partial sum; after a barrier each thread sums the partials of its own range of
 * columns, in thread order. The split depends only on the team's size, so a result is the same on every
 * call: no dynamic schedule, whose row-to-thread map (and so rounding) would change from call to call.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void rows(float *acc, const float *x, const float *S, int64_t i0, int64_t i1, int64_t out, int64_t ld) {
    int64_t i = i0;
    /* eight rows at a time: one load and store of the partial per eight weights read */
    for (; i + 8 <= i1; i += 8) {
        const float x0 = x[i], x1 = x[i + 1], x2 = x[i + 2], x3 = x[i + 3];
        const float x4 = x[i + 4], x5 = x[i + 5], x6 = x[i + 6], x7 = x[i + 7];
        const float *s0 = S + i * ld, *s1 = s0 + ld, *s2 = s1 + ld, *s3 = s2 + ld;
        const float *s4 = s3 + ld, *s5 = s4 + ld, *s6 = s5 + ld, *s7 = s6 + ld;
#pragma omp simd
        for (int64_t j = 0; j < out; j++)
            acc[j] += (x0 * s0[j] + x1 * s1[j] + x2 * s2[j] + x3 * s3[j]) +
                      (x4 * s4[j] + x5 * s5[j] + x6 * s6[j] + x7 * s7[j]);
    }
    for (; i < i1; i++) {
        const float xi = x[i];
        const float *s = S + i * ld;
#pragma omp simd
        for (int64_t j = 0; j < out; j++) acc[j] += xi * s[j];
    }
}

/* Returns 0, or -1 when the partials could not be allocated (y untouched). */
int specmesh_gemv(float *y, const float *x, const float *S, const float *b, int64_t in, int64_t out, int64_t ld,
                  int threads) {
    if (threads < 1) threads = 1;
    const size_t bytes = ((size_t)threads * (size_t)out * sizeof(float) + 63) / 64 * 64;
    float *part = aligned_alloc(64, bytes);
    if (!part) return -1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t octs = (in + 7) / 8;
        const int64_t i0 = 8 * (octs * t / n), i1 = t == n - 1 ? in : 8 * (octs * (t + 1) / n);
        float *acc = part + (int64_t)t * out;
        memset(acc, 0, sizeof(float) * out);
        rows(acc, x, S, i0, i1, out, ld);
#pragma omp barrier
        const int64_t j0 = out * t / n, j1 = out * (t + 1) / n;
        for (int64_t j = j0; j < j1; j++) {
            float v = 0.f;
            for (int u = 0; u < n; u++) v += part[(int64_t)u * out + j];
            y[j] = b ? v + b[j] : v;
        }
    }
    free(part);
    return 0;
}
