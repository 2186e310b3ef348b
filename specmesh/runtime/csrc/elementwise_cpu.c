/* The steps between a ragged forward's matrix products on the CPU: RMSNorm and SwiGLU's silu(gate) * up, one
 * call each over every row of the batch. torch runs an fp32 RMSNorm as five operators (pow, mean, add, rsqrt,
 * two muls) and SwiGLU as two, each a pass over memory and a dispatch: on a 16 x 5 verify batch of the demo
 * target they cost ~3 ms of a ~40 ms forward whose products take ~30. See cpu_kernels.py.
 *
 * Rows go to the team in fixed ranges; a row's arithmetic never depends on the others or on the split.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "rms_row.h"

/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w for rows [0, n) of H (x's rows ldx apart, y's H) */
void specmesh_rms_norm(float *y, const float *x, const float *w, float eps, int64_t n, int64_t H, int64_t ldx,
                       int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < n; r++) rms_row(y + r * H, x + r * ldx, w, eps, H);
}

/* y[r][i] = silu(gu[r][i]) * gu[r][I + i] for rows [0, n) (gu's rows ldg apart, y's I) */
void specmesh_silu_mul(float *y, const float *gu, int64_t n, int64_t I, int64_t ldg, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < n; r++) {
        const float *g = gu + r * ldg, *u = g + I;
        float *yr = y + r * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) yr[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}
