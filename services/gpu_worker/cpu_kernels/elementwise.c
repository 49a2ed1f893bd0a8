/* The decoder layer's small ops on the CPU in fp32, one call each instead of 5-10 torch ops: at decode batch sizes
   their cost is per-op overhead, not arithmetic (model/ops.py's CpuOps calls these; TorchOps is the reference).

     rms_norm         y = w * (h * 1 / sqrt(mean(h^2) + eps)), h = x (+ residual, then written back as the residual)
     rotary_neox      q, k rotated in place: x * cos + rotate_half(x) * sin, cos/sin rows picked by position
     silu_and_mul     out = silu(gate) * up, gate and up the two halves of each row
     argmax_rows      each row's index of its largest value (greedy sampling over the vocabulary)

   Built with -ffp-contract=off so products and sums round as torch's separate ops do: rotary and the residual add
   match torch bit for bit; rms_norm differs from torch only in the order of its sum of squares, silu in its exp.
   Every row is computed on its own, so a token's result does not depend on the batch. */

#include <math.h>
#include <stdint.h>

#include "vector_width.h"

#define PAR_MIN_ELEMS 8192     /* below this many elements one thread does it all (OpenMP start-up costs more) */

int steploop_rms_norm(float *y, float *x, float *residual, const float *w, int64_t T, int64_t H, float eps,
                      int num_threads)
{
    if (T < 0 || H <= 0)
        return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T * H >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        float *xt = x + t * H, *yt = y + t * H;     /* yt may be xt (in place): read h, then write */
        const float *h = xt;
        if (residual) {
            float *rt = residual + t * H;
            for (int64_t i = 0; i < H; i++)
                rt[i] = xt[i] + rt[i];
            h = rt;
        }
        float lanes[16] = {0};             /* 16 partial sums, added pairwise: vectorizes, fixed order */
        int64_t i = 0;
        for (; i + 16 <= H; i += 16)
            for (int j = 0; j < 16; j++)
                lanes[j] += h[i + j] * h[i + j];
        for (int width = 8; width >= 1; width /= 2)
            for (int j = 0; j < width; j++)
                lanes[j] += lanes[j + width];
        float sum = lanes[0];
        for (; i < H; i++)
            sum += h[i] * h[i];
        float r = 1.0f / sqrtf(sum / (float)H + eps);
        for (int64_t j = 0; j < H; j++)
            yt[j] = w[j] * (h[j] * r);
    }
    return 0;
}

/* q [T, Hq, D] and k [T, Hk, D] with row strides q_row, k_row (elements), heads contiguous; cos, sin [P, D];
   positions [T] int64. Returns -1 if a position is outside [0, P) (nothing is written then). */
int steploop_rotary_neox(float *q, float *k, const int64_t *positions, const float *cos_table,
                         const float *sin_table, int64_t T, int64_t Hq, int64_t Hk, int64_t D, int64_t q_row,
                         int64_t k_row, int64_t P, int num_threads)
{
    if (T < 0 || D <= 0 || D % 2 || D > 1024)
        return -1;
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= P)
            return -1;
    int64_t half = D / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T * (Hq + Hk) * D >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const float *restrict c = cos_table + positions[t] * D, *restrict s = sin_table + positions[t] * D;
        for (int64_t head = 0; head < Hq + Hk; head++) {
            float *restrict x = head < Hq ? q + t * q_row + head * D : k + t * k_row + (head - Hq) * D;
            float out[1024];
            for (int64_t i = 0; i < half; i++)          /* rotate_half(x) = (-x2, x1) */
                out[i] = x[i] * c[i] + (-x[i + half]) * s[i];
            for (int64_t i = half; i < D; i++)
                out[i] = x[i] * c[i] + x[i - half] * s[i];
            for (int64_t i = 0; i < D; i++)
                x[i] = out[i];
        }
    }
    return 0;
}

/* exp(x), ~2 ulp, VL lanes at a time (glibc's expf is a scalar call; each lane's value is the same whatever VL):
   n rounded with the 1.5 * 2^23 trick (this file is built without -fassociative-math, which would fold it) */
static inline vf exp_lanes(vf x)
{
    vf hi = (vf){0} + 88.0f, lo = (vf){0} - 87.0f;
    x = select_lanes(x < hi, x, hi);
    x = select_lanes(x > lo, x, lo);
    return exp_reduced(x, (x * 1.44269504f + 12582912.0f) - 12582912.0f);
}

static inline vf silu_mul_lanes(vf g, vf u)
{
    return g / (1.0f + exp_lanes(-g)) * u;
}

static void silu_and_mul_row(float *restrict o, const float *restrict gate, const float *restrict up, int64_t I)
{
    int64_t i = 0;
    for (; i + VL <= I; i += VL) {
        vf g, u;
        __builtin_memcpy(&g, gate + i, sizeof g);
        __builtin_memcpy(&u, up + i, sizeof u);
        vf y = silu_mul_lanes(g, u);
        __builtin_memcpy(o + i, &y, sizeof y);
    }
    if (i < I) {                                   /* the tail goes through the same lanes, zero-padded */
        vf g = {0}, u = {0};
        for (int64_t j = 0; j < I - i; j++) {
            g[j] = gate[i + j];
            u[j] = up[i + j];
        }
        vf y = silu_mul_lanes(g, u);
        for (int64_t j = 0; j < I - i; j++)
            o[i + j] = y[j];
    }
}

/* x [T, 2I] (gate | up) -> out [T, I] */
int steploop_silu_and_mul(float *out, const float *x, int64_t T, int64_t I, int num_threads)
{
    if (T < 0 || I <= 0)
        return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T * I >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++)
        silu_and_mul_row(out + t * I, x + t * 2 * I, x + t * 2 * I + I, I);
    return 0;
}

/* The first index of x's largest value, or of its first NaN when it has one (torch.argmax's answer: NaN counts
   as the largest). A vector pass finds the maximum (comparisons are false for NaN, which a second mask records),
   then a second pass finds where it first occurs; the row (192 KiB for a 49k vocabulary) is in cache for it. */
static int64_t argmax_row(const float *x, int64_t C)
{
    vf best, v;
    vi nan_seen = {0};
    for (int j = 0; j < VL; j++)
        best[j] = -INFINITY;
    int64_t i = 0;
    for (; i + VL <= C; i += VL) {
        __builtin_memcpy(&v, x + i, sizeof v);
        vi greater = v > best;
        nan_seen |= v != v;
        best = select_lanes(greater, v, best);
    }
    float top = -INFINITY;
    int any_nan = 0;
    for (int j = 0; j < VL; j++) {
        top = best[j] > top ? best[j] : top;
        any_nan |= nan_seen[j] != 0;
    }
    for (int64_t k = i; k < C; k++) {
        top = x[k] > top ? x[k] : top;
        any_nan |= x[k] != x[k];
    }
    int64_t k = 0;
    if (!any_nan)                                  /* skip whole vectors without the maximum */
        for (; k + VL <= C; k += VL) {
            __builtin_memcpy(&v, x + k, sizeof v);
            vi hit = v == top;
            int any = 0;
            for (int j = 0; j < VL; j++)
                any |= hit[j];
            if (any)
                break;
        }
    for (; k < C; k++)
        if (any_nan ? x[k] != x[k] : x[k] == top)
            return k;
    return 0;
}

/* x [R, C] fp32 -> out [R] int64 */
int steploop_argmax_rows(int64_t *out, const float *x, int64_t R, int64_t C, int num_threads)
{
    if (R < 0 || C <= 0)
        return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (R * C >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < R; r++)
        out[r] = argmax_row(x + r * C, C);
    return 0;
}
