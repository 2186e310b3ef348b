/* One row's RMSNorm, the one the CPU kernels share (decode_step_cpu.c per thread, elementwise_cpu.c per batch
 * row): y = x / sqrt(mean(x^2) + eps) * w over n floats; y may be x. */
#ifndef SPECMESH_RMS_ROW_H
#define SPECMESH_RMS_ROW_H

#include <math.h>
#include <stdint.h>

static inline void rms_row(float *y, const float *x, const float *w, float eps, int64_t n) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

#endif
