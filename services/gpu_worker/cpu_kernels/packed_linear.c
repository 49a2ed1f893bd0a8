/* y = x @ W.T on the CPU in fp32, with W held in a lossless packed form of its block-quantized values.

   Checkpoints dequantized from GGUF (the default model's Q4_1 layers and Q8_0 embedding) hold fp32 weights that are
   exactly d * q + m per block of 32 along K. packed_weights.py recovers (d, m, q) and checks the round trip bit for
   bit, so this kernel multiplies by the very same fp32 weights while reading 6 (Q4_1) or 9 (Q8_0) bits per weight
   from memory instead of 32: at decode batch sizes the fp32 matmul is memory-bound on a small CPU.

   Layout, per group of 16 output rows (g = n / 16), so one vector load yields 16 rows' values at one k:
     Q4_1: qs uint8 [N/16][K/2][16]: byte = q(k even) | q(k odd) << 4;  d, m float [N/16][K/32][16]
     Q8_0: qs int8  [N/16][K][16];                                       d      float [N/16][K/32][16]
   Dequantizing is exact: d * q is exact in fp32 since d is an fp16 value and |q| < 256, so the fused multiply-add
   rounds once, as numpy's d * q + m does. For small batches each 16-row group is dequantized in registers and used
   at once; larger batches dequantize a tile of 32 output rows into a [K][32] fp32 scratch once,
   then MR x 32 register blocks accumulate broadcast(x[r, k]) * scratch[k, :] over k.

   Every output y[r, n] is one fma chain over k = 0 .. K-1 in order, whatever M, the row's place in the batch, or
   the register block it fell in: a token's result does not depend on the rest of the batch. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#define QK 32    /* weights per quantization block along K */
#define G 16     /* output rows per layout group (one vector) */
#define NR 32    /* output rows per tile (two groups) */
#define MR 8     /* x rows per register block */
#define FUSED_M 16        /* x rows per pass of the fused path */
/* batches up to this many rows take the fused path (benchmarks/packed_linear.py, a whole forward's weights: with x
   transposed it beats the scratch tile up to ~48 rows, 187 vs 162 GFLOP/s at 20; the tile wins from ~64) */
#define FUSED_MAX_M_Q4_1 48
#define FUSED_MAX_M_Q8_0 48

enum { KIND_Q4_1 = 0, KIND_Q8_0 = 1 };

static inline v16f load16(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16f v) { memcpy(p, &v, sizeof v); }

/* 16 bytes widened to 16 int32 lanes. gcc scalarizes __builtin_convertvector from 8-bit lanes (dozens of byte
   inserts per vector, which made dequantizing ~4x slower), so the x86 widening instructions are spelled out. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline v16i widen_u8(const uint8_t *p) { return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline v16i widen_s8(const int8_t *p) { return (v16i)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
#elif defined(__AVX2__)
#include <immintrin.h>
static inline v16i widen_u8(const uint8_t *p)
{
    __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    v16i v;
    memcpy(&v, &lo, 32);
    memcpy((char *)&v + 32, &hi, 32);
    return v;
}
static inline v16i widen_s8(const int8_t *p)
{
    __m256i lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    v16i v;
    memcpy(&v, &lo, 32);
    memcpy((char *)&v + 32, &hi, 32);
    return v;
}
#else
static inline v16i widen_u8(const uint8_t *p) { v16i v; for (int i = 0; i < 16; i++) v[i] = p[i]; return v; }
static inline v16i widen_s8(const int8_t *p) { v16i v; for (int i = 0; i < 16; i++) v[i] = p[i]; return v; }
#endif

/* dequantize group g (16 rows) into scratch columns [col, col + 16) of a [K][NR] tile */
static void dequant_q4_1(const uint8_t *qs, const float *d, const float *m, int64_t g, int64_t K, float *tile,
                         int64_t col)
{
    const uint8_t *q = qs + g * (K / 2) * G;
    const float *dg = d + g * (K / QK) * G, *mg = m + g * (K / QK) * G;
    for (int64_t b = 0; b < K / QK; b++) {
        v16f db = load16(dg + b * G), mb = load16(mg + b * G);
        for (int64_t p = 0; p < QK / 2; p++) {
            int64_t k = b * QK + 2 * p;
            v16i iv = widen_u8(q + (k / 2) * G);
            store16(tile + k * NR + col, __builtin_convertvector(iv & 15, v16f) * db + mb);
            store16(tile + (k + 1) * NR + col, __builtin_convertvector(iv >> 4, v16f) * db + mb);
        }
    }
}

static void dequant_q8_0(const int8_t *qs, const float *d, int64_t g, int64_t K, float *tile, int64_t col)
{
    const int8_t *q = qs + g * K * G;
    const float *dg = d + g * (K / QK) * G;
    for (int64_t b = 0; b < K / QK; b++) {
        v16f db = load16(dg + b * G);
        for (int64_t j = 0; j < QK; j++) {
            int64_t k = b * QK + j;
            store16(tile + k * NR + col, __builtin_convertvector(widen_s8(q + k * G), v16f) * db);
        }
    }
}

/* y[r, 0:16*nv] = sum_k x[r, k] * tile[k, 0:16*nv] for r < mr; mr and nv are constants after inlining */
static inline __attribute__((always_inline)) void block(int mr, int nv, const float *restrict x, int64_t K,
                                                        const float *restrict tile, float *restrict y, int64_t N)
{
    v16f acc[MR][2];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++)
            acc[r][v] = (v16f){0};
    for (int64_t k = 0; k < K; k++) {
        v16f w0 = load16(tile + k * NR), w1 = nv > 1 ? load16(tile + k * NR + G) : (v16f){0};
        for (int r = 0; r < mr; r++) {
            float xv = x[r * K + k];
            acc[r][0] += xv * w0;
            if (nv > 1)
                acc[r][1] += xv * w1;
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++)
            store16(y + r * N + v * G, acc[r][v]);
}

#define BLOCK_CASE(R)                                   \
    case R:                                             \
        if (nv == 2)                                    \
            block(R, 2, x, K, tile, y, N);              \
        else                                            \
            block(R, 1, x, K, tile, y, N);              \
        break;

static void block_dispatch(int mr, int nv, const float *x, int64_t K, const float *tile, float *y, int64_t N)
{
    switch (mr) {
        BLOCK_CASE(1) BLOCK_CASE(2) BLOCK_CASE(3) BLOCK_CASE(4)
        BLOCK_CASE(5) BLOCK_CASE(6) BLOCK_CASE(7) BLOCK_CASE(8)
    }
}

/* Small batches (M <= FUSED_MAX_M_*): no scratch; each group of 16 output rows is dequantized in registers, one pair
   of k at a time, and used at once by up to FUSED_M rows (dequantizing is then ~6 vector ops per 32 fmas). x comes
   transposed (xt[k][r], see steploop_packed_linear) so all rows broadcast from one pointer: with x[r * K + k], gcc
   kept a pointer per row and, past ~12 rows, spilled them into vector registers inside the loop. One
   group per work item: walking 2 or 4 groups side by side (independent fma chains for few rows) measured slower
   at every M from 1 to 16 on a whole forward's weights (M = 4: 9.9 vs 8.1 ms), and coarser items split a
   576-row matrix unevenly over the threads. */
static inline __attribute__((always_inline)) void fused_q4_1(int mr, const float *restrict xt, int64_t K,
                                                             const uint8_t *restrict qs, const float *restrict d,
                                                             const float *restrict m, int64_t g,
                                                             float *restrict y, int64_t N)
{
    v16f acc[FUSED_M];
    for (int r = 0; r < mr; r++)
        acc[r] = (v16f){0};
    for (int64_t b = 0; b < K / QK; b++) {
        v16f db = load16(d + (g * (K / QK) + b) * G), mb = load16(m + (g * (K / QK) + b) * G);
        for (int64_t p = 0; p < QK / 2; p++) {
            int64_t k = b * QK + 2 * p;
            v16i iv = widen_u8(qs + (g * (K / 2) + k / 2) * G);
            v16f w0 = __builtin_convertvector(iv & 15, v16f) * db + mb;
            v16f w1 = __builtin_convertvector(iv >> 4, v16f) * db + mb;
            for (int r = 0; r < mr; r++)
                acc[r] += xt[k * mr + r] * w0;
            for (int r = 0; r < mr; r++)
                acc[r] += xt[(k + 1) * mr + r] * w1;
        }
    }
    for (int r = 0; r < mr; r++)
        store16(y + r * N + g * G, acc[r]);
}

static inline __attribute__((always_inline)) void fused_q8_0(int mr, const float *restrict xt, int64_t K,
                                                             const int8_t *restrict qs, const float *restrict d,
                                                             int64_t g, float *restrict y, int64_t N)
{
    v16f acc[FUSED_M];
    for (int r = 0; r < mr; r++)
        acc[r] = (v16f){0};
    for (int64_t b = 0; b < K / QK; b++) {
        v16f db = load16(d + (g * (K / QK) + b) * G);
        for (int64_t i = 0; i < QK; i++) {
            int64_t k = b * QK + i;
            v16f w = __builtin_convertvector(widen_s8(qs + (g * K + k) * G), v16f) * db;
            for (int r = 0; r < mr; r++)
                acc[r] += xt[k * mr + r] * w;
        }
    }
    for (int r = 0; r < mr; r++)
        store16(y + r * N + g * G, acc[r]);
}

#define FUSED_CASE(R)                                                  \
    case R:                                                            \
        if (kind == KIND_Q4_1)                                         \
            fused_q4_1(R, xt, K, qs, d, m, g, y, N);                   \
        else                                                           \
            fused_q8_0(R, xt, K, qs, d, g, y, N);                      \
        break;

static void fused_dispatch(int mr, int kind, const float *xt, int64_t K, const void *qs, const float *d,
                           const float *m, int64_t g, float *y, int64_t N)
{
    switch (mr) {
        FUSED_CASE(1) FUSED_CASE(2) FUSED_CASE(3) FUSED_CASE(4) FUSED_CASE(5) FUSED_CASE(6) FUSED_CASE(7)
        FUSED_CASE(8) FUSED_CASE(9) FUSED_CASE(10) FUSED_CASE(11) FUSED_CASE(12) FUSED_CASE(13) FUSED_CASE(14)
        FUSED_CASE(15) FUSED_CASE(16)
    }
}

/* The calling thread's buffer for x transposed (grown as needed, kept for the next call: this runs ~120 times a
   step). NULL when out of memory. */
static float *transposed_buffer(int64_t n)
{
    static __thread float *buf;
    static __thread int64_t cap;
    if (n > cap) {
        free(buf);
        cap = (n + 4095) & ~(int64_t)4095;
        buf = aligned_alloc(64, (size_t)cap * sizeof(float));
        if (!buf)
            cap = 0;
    }
    return buf;
}

/* x [M, K], y [M, N] fp32 row-major; N % 16 == 0, K % 32 == 0. Returns 0, or -1 on bad sizes or no memory. */
int steploop_packed_linear(float *y, const float *x, const void *qs, const float *d, const float *m, int64_t M,
                           int64_t N, int64_t K, int kind, int num_threads)
{
    if (M < 0 || N <= 0 || K <= 0 || N % G || K % QK || (kind != KIND_Q4_1 && kind != KIND_Q8_0))
        return -1;
    if (M == 0)
        return 0;
    if (M <= (kind == KIND_Q4_1 ? FUSED_MAX_M_Q4_1 : FUSED_MAX_M_Q8_0)) {
        /* passes of up to FUSED_M rows; pass p's rows transposed to xt + p * FUSED_M * K as [K][rows] */
        float *xt = transposed_buffer(M * K);
        if (!xt)
            return -1;
#pragma omp parallel num_threads(num_threads)
        {
#pragma omp for schedule(static)
            for (int64_t k = 0; k < K; k++)
                for (int64_t r0 = 0; r0 < M; r0 += FUSED_M) {
                    int64_t mr = M - r0 < FUSED_M ? M - r0 : FUSED_M;
                    for (int64_t r = 0; r < mr; r++)
                        xt[r0 * K + k * mr + r] = x[(r0 + r) * K + k];
                }
#pragma omp for schedule(static)
            for (int64_t g = 0; g < N / G; g++)
                for (int64_t r0 = 0; r0 < M; r0 += FUSED_M)
                    fused_dispatch(M - r0 < FUSED_M ? (int)(M - r0) : FUSED_M, kind, xt + r0 * K, K, qs, d, m, g,
                                   y + r0 * N, N);
        }
        return 0;
    }
    int64_t num_tiles = (N + NR - 1) / NR;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *tile = aligned_alloc(64, (size_t)K * NR * sizeof(float));
        if (!tile)
            failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tiles; t++) {
            if (!tile)
                continue;
            int nv = (N - t * NR) >= NR ? 2 : 1;
            for (int v = 0; v < nv; v++) {
                if (kind == KIND_Q4_1)
                    dequant_q4_1(qs, d, m, t * 2 + v, K, tile, v * G);
                else
                    dequant_q8_0(qs, d, t * 2 + v, K, tile, v * G);
            }
            for (int64_t r = 0; r < M; r += MR) {
                int mr = M - r < MR ? (int)(M - r) : MR;
                block_dispatch(mr, nv, x + r * K, K, tile, y + r * N + t * NR, N);
            }
        }
        free(tile);
    }
    return failed ? -1 : 0;
}
