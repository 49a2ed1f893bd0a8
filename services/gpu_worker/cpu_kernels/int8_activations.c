/* y = x @ W.T for GGUF Q4_K and Q6_K weights (packed_linear.c's forms) with int8 activations: opt-in, NOT exact.

   The exact kernels (packed_linear.c) multiply fp32 x by the file's dequantized fp32 weights: ~9 vector
   instructions per 16 weights in the one-row kernel, which on an AVX2 CPU makes a one-stream decode compute-bound
   at ~1.8x the memory-bandwidth bound. llama.cpp instead rounds x to int8 and multiplies in integers (maddubs: 32
   byte products a instruction). This file does the same for the two types of a Q4_K_M file, when
   steploop_set_int8_activations(1) was called (the worker's --cpu-int8-activations):

     x, per row and block of 32 along K:  dx = max|x| / 127, xq = roundf(x / dx) in -127..127 (llama.cpp's Q8_0
                                          rule), and the sums of xq per 16
     Q4_K, sub-block b (32 k):            y += dx * ((d sc) * sum(q xq) - (dmin mn) * sum(xq))
     Q6_K, sub-blocks j, j+1 (16 k each): y += dx * ((d sc_j) * sum_j((q - 32) xq) + (d sc_j+1) * sum_j+1(...))

   The integer sums are exact; the float epilogue is the same sequence of roundings (one multiply, then fmas) in the
   AVX2 and the portable code, so both builds give the same bits, and each output row's result depends only on its
   own x row: batch invariant, as the exact kernels are. What differs from the fp32 reference is x's rounding to 8
   bits: ~0.4% relative error per product, the error llama.cpp's outputs carry.

   Layout (packed_linear.c): per group of 16 output rows, qs uint8 [N/16][K/2][16] (byte = q(k even) | q(k odd)
   << 4). A 32-byte load holds two k pairs of 16 rows; unpacking its low and high nibbles byte by byte gives each
   row's (k, k+1) as adjacent bytes, which maddubs multiplies by (xq[k], xq[k+1]) and adds: 16 rows x 4 k in ~10
   instructions. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define G 16
#define QK 32
#define QK_K 256
#define ROWS 64          /* x rows per pass over a group's weights (their 16 accumulators each stay on the stack) */

int steploop_int8_activations_on = 0;

void steploop_set_int8_activations(int on) { steploop_int8_activations_on = !!on; }

int steploop_int8_activations(void) { return steploop_int8_activations_on; }

/* x [M, K] -> xq int8 [M, K], dx [M, K/32], xs int32 [M, K/16] (sums of xq per 16) */
static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, int32_t *xs)
{
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < K / QK; b++) {
            const float *xb = x + r * K + b * QK;
            float amax = 0.0f;
            for (int k = 0; k < QK; k++)
                amax = fmaxf(amax, fabsf(xb[k]));
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int8_t *qb = xq + r * K + b * QK;
            int32_t s[2] = {0, 0};
            for (int k = 0; k < QK; k++) {
                float v = roundf(xb[k] * id);
                v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
                qb[k] = (int8_t)v;
                s[k / 16] += qb[k];
            }
            dx[r * (K / QK) + b] = d;
            xs[r * (K / 16) + 2 * b] = s[0];
            xs[r * (K / 16) + 2 * b + 1] = s[1];
        }
}

/* ---- integer sums over 32 (Q4_K) or 16 (Q6_K) k of one group's 16 rows against one x row ---- */

#if defined(__AVX2__)
/* xq[k .. k+3] as maddubs' right operand: lane 0 (xq[k], xq[k+1]) x 8, lane 1 (xq[k+2], xq[k+3]) x 8 */
static inline __m256i x_pairs(const int8_t *xq)
{
    const __m256i ctl = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                         2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    int32_t x4;
    memcpy(&x4, xq, 4);
    return _mm256_shuffle_epi8(_mm256_set1_epi32(x4), ctl);
}

/* int16 lanes [rows 0-7 over (k, k+1) | rows 0-7 over (k+2, k+3)] -> int32 rows 0-7 */
static inline __m256i rows_i32(__m256i a)
{
    return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(a)),
                            _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a, 1)));
}

/* sum over k in [k0, k0 + 32) of q[row, k] * xq[k] for the group's 16 rows (Q4_K: q in 0..15) */
static inline void q4_sums(const uint8_t *qs, const int8_t *xq, int32_t out[G])
{
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {               /* 4 k a step; int16 lanes hold <= 8 * 2 * 15 * 127 = 30480 */
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + j * 32));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        __m256i xv = x_pairs(xq + 4 * j);
        a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(_mm256_unpacklo_epi8(lo, hi), xv));
        a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(_mm256_unpackhi_epi8(lo, hi), xv));
    }
    _mm256_storeu_si256((__m256i *)out, rows_i32(a0));
    _mm256_storeu_si256((__m256i *)(out + 8), rows_i32(a1));
}

/* sum over k in [k0, k0 + 16) of q[row, k] * xq[k] for 16 rows (Q6_K: q in 0..63 from nibbles lo and two high
   bits hb per weight) */
static inline void q6_sums(const uint8_t *lo_qs, const uint8_t *hb, const int8_t *xq, int32_t out[G])
{
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    const __m256i shift_lo = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4), shift_hi = _mm256_setr_epi32(2, 2, 2, 2, 6, 6, 6, 6);
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int half = 0; half < 2; half++) {      /* int16 lanes hold <= 2 * 2 * 63 * 127 = 32004 */
        __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
        for (int j = 2 * half; j < 2 * half + 2; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(lo_qs + j * 32));
            __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(hb + j * 16)));
            /* byte bits 2i, 2i+1 hold weight k+i's high bits: lanes (k | k+2) from shifts (0 | 4), (k+1 | k+3)
               from (2 | 6) */
            __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m4),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srlv_epi32(h, shift_lo), m2), 4));
            __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srlv_epi32(h, shift_hi), m2), 4));
            __m256i xv = x_pairs(xq + 4 * j);
            a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(_mm256_unpacklo_epi8(lo, hi), xv));
            a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(_mm256_unpackhi_epi8(lo, hi), xv));
        }
        s0 = _mm256_add_epi32(s0, rows_i32(a0));
        s1 = _mm256_add_epi32(s1, rows_i32(a1));
    }
    _mm256_storeu_si256((__m256i *)out, s0);
    _mm256_storeu_si256((__m256i *)(out + 8), s1);
}
#else
static inline void q4_sums(const uint8_t *qs, const int8_t *xq, int32_t out[G])
{
    for (int i = 0; i < G; i++)
        out[i] = 0;
    for (int p = 0; p < QK / 2; p++)
        for (int i = 0; i < G; i++) {
            uint8_t byte = qs[p * G + i];
            out[i] += (byte & 15) * xq[2 * p] + (byte >> 4) * xq[2 * p + 1];
        }
}

static inline void q6_sums(const uint8_t *lo_qs, const uint8_t *hb, const int8_t *xq, int32_t out[G])
{
    for (int i = 0; i < G; i++)
        out[i] = 0;
    for (int k = 0; k < 16; k++)
        for (int i = 0; i < G; i++) {
            uint8_t byte = lo_qs[(k / 2) * G + i];
            int q = (k % 2 ? byte >> 4 : byte & 15) | (((hb[(k / 4) * G + i] >> (2 * (k % 4))) & 3) << 4);
            out[i] += q * xq[k];
        }
}
#endif

/* ---- the float epilogue: the same roundings in every build ---- */

#if defined(__AVX2__)
/* acc[i] = fma(a[i] * s0[i] - b[i] * c, dx, acc[i]) for the 16 rows (Q4_K: a = d sc, b = dmin mn, c = sum xq) */
static inline void q4_epilogue(float *acc, const float *a, const float *b, const int32_t *s, float c, float dx)
{
    for (int h = 0; h < G; h += 8) {
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(a + h), _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(s + h))));
        t = _mm256_fnmadd_ps(_mm256_loadu_ps(b + h), _mm256_set1_ps(c), t);
        _mm256_storeu_ps(acc + h, _mm256_fmadd_ps(t, _mm256_set1_ps(dx), _mm256_loadu_ps(acc + h)));
    }
}

/* acc[i] = fma(fma(a1[i], s1[i], a0[i] * s0[i]), dx, acc[i]) (Q6_K: a = d sc per 16, s = sums of (q - 32) xq) */
static inline void q6_epilogue(float *acc, const float *a0, const int32_t *s0, const float *a1, const int32_t *s1,
                               float dx)
{
    for (int h = 0; h < G; h += 8) {
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(a0 + h), _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(s0 + h))));
        t = _mm256_fmadd_ps(_mm256_loadu_ps(a1 + h), _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(s1 + h))), t);
        _mm256_storeu_ps(acc + h, _mm256_fmadd_ps(t, _mm256_set1_ps(dx), _mm256_loadu_ps(acc + h)));
    }
}
#else
static inline void q4_epilogue(float *acc, const float *a, const float *b, const int32_t *s, float c, float dx)
{
    for (int i = 0; i < G; i++) {
        float t = a[i] * (float)s[i];
        t = fmaf(-b[i], c, t);
        acc[i] = fmaf(t, dx, acc[i]);
    }
}

static inline void q6_epilogue(float *acc, const float *a0, const int32_t *s0, const float *a1, const int32_t *s1,
                               float dx)
{
    for (int i = 0; i < G; i++) {
        float t = a0[i] * (float)s0[i];
        t = fmaf(a1[i], (float)s1[i], t);
        acc[i] = fmaf(t, dx, acc[i]);
    }
}
#endif

/* out[i] = d[i] * scale[i] for the 16 rows (the scales int8 when is_signed, else uint8): exact products */
static inline void scale_products(const float *d, const int8_t *scale, int is_signed, float out[G])
{
#if defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)scale);
    for (int h = 0; h < 2; h++, b = _mm_srli_si128(b, 8)) {
        __m256i i32 = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
        _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(_mm256_loadu_ps(d + 8 * h), _mm256_cvtepi32_ps(i32)));
    }
#else
    for (int i = 0; i < G; i++)
        out[i] = d[i] * (float)(is_signed ? scale[i] : (uint8_t)scale[i]);
#endif
}

/* ---- drivers: each thread takes whole groups of 16 output rows; each x row's outputs are its own sums ---- */

typedef struct {
    int8_t *xq;
    float *dx;
    int32_t *xs;
} quantized_x;

static int quantize(const float *x, int64_t M, int64_t K, quantized_x *q)
{
    q->xq = malloc((size_t)(M * K));
    q->dx = malloc((size_t)(M * (K / QK)) * sizeof(float));
    q->xs = malloc((size_t)(M * (K / 16)) * sizeof(int32_t));
    if (!q->xq || !q->dx || !q->xs)
        return -1;
    quantize_rows(x, M, K, q->xq, q->dx, q->xs);
    return 0;
}

static void release(quantized_x *q)
{
    free(q->xq);
    free(q->dx);
    free(q->xs);
}

/* One call's arrays and its quantized x */
typedef struct {
    float *y;
    const uint8_t *qs, *sc, *mn, *qh;
    const float *d, *dmin;
    int64_t M, N, K;
    quantized_x q;
} job;

static int job_start(job *j, float *y, const float *x, const uint8_t *qs, const float *dd, const uint8_t *scales,
                     int64_t M, int64_t N, int64_t K)
{
    /* Q4_K: sc, mn uint8 per 32; d, dmin per 256. Q6_K: sc int8 per 16; d per 256; high bits after the nibbles */
    *j = (job){y, qs, scales, scales + N * (K / QK), qs + N * K / 2, dd, dd + N * (K / QK_K), M, N, K,
               {NULL, NULL, NULL}};
    if (M < 0 || N <= 0 || K <= 0 || N % G || K % QK_K)
        return -1;
    return M == 0 ? 0 : quantize(x, M, K, &j->q);
}

/* Group g's 16 outputs for every x row, ROWS rows a pass (their accumulators on the stack). q6 picks the form, a
   constant: each driver's parallel loop inlines its own copy (1.4x faster at 16 rows than one loop deciding the
   form at run time; blocking several x rows on each unpacked step bought nothing more and cost 10% at one row).
   Each x row's outputs are its own integer sums and the same float epilogue, whatever M or the pass. */
static inline __attribute__((always_inline)) void group_rows(int q6, const job *j, int64_t g)
{
    int64_t K = j->K;
    float acc[ROWS][G], a0[G], a1[G];
    int32_t s0[G], s1[G];
    for (int64_t r0 = 0; r0 < j->M; r0 += ROWS) {
        int64_t rows = j->M - r0 < ROWS ? j->M - r0 : ROWS;
        memset(acc, 0, (size_t)rows * sizeof acc[0]);
        for (int64_t blk = 0; blk < K / QK; blk++) {
            const float *dg = j->d + (g * (K / QK_K) + blk / (QK_K / QK)) * G;
            if (q6) {                                /* d sc per 16: exact (11 x 8 significant bits) */
                const int8_t *scg = (const int8_t *)j->sc + (g * (K / 16) + 2 * blk) * G;
                scale_products(dg, scg, 1, a0);
                scale_products(dg, scg + G, 1, a1);
            } else {                                 /* d sc and dmin mn per 32: exact (11 x 6 bits) */
                const float *mg = j->dmin + (g * (K / QK_K) + blk / (QK_K / QK)) * G;
                scale_products(dg, (const int8_t *)j->sc + (g * (K / QK) + blk) * G, 0, a0);
                scale_products(mg, (const int8_t *)j->mn + (g * (K / QK) + blk) * G, 0, a1);
            }
            const uint8_t *lo = j->qs + (g * (K / 2) + blk * (QK / 2)) * G;
            const uint8_t *hb = j->qh + (g * (K / 4) + blk * (QK / 4)) * G;
            for (int64_t r = 0; r < rows; r++) {
                int64_t row = r0 + r;
                const int8_t *xb = j->q.xq + row * K + blk * QK;
                const int32_t *xs = j->q.xs + row * (K / 16) + 2 * blk;
                float dx = j->q.dx[row * (K / QK) + blk];
                if (q6) {
                    q6_sums(lo, hb, xb, s0);
                    q6_sums(lo + 8 * G, hb + 4 * G, xb + 16, s1);
                    for (int c = 0; c < G; c++) {        /* (q - 32) xq summed: exact in int32 */
                        s0[c] -= 32 * xs[0];
                        s1[c] -= 32 * xs[1];
                    }
                    q6_epilogue(acc[r], a0, s0, a1, s1, dx);
                } else {
                    q4_sums(lo, xb, s0);
                    q4_epilogue(acc[r], a0, a1, s0, (float)(xs[0] + xs[1]), dx);
                }
            }
        }
        for (int64_t r = 0; r < rows; r++)
            memcpy(j->y + (r0 + r) * j->N + g * G, acc[r], sizeof acc[r]);
    }
}

/* Each thread takes whole groups of 16 outputs */
#define DRIVE(Q6)                                                                         \
    job j;                                                                                \
    int rc = job_start(&j, y, x, qs, dd, scales, M, N, K);                                \
    if (rc == 0 && M > 0) {                                                               \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")             \
        for (int64_t g = 0; g < N / G; g++)                                               \
            group_rows(Q6, &j, g);                                                        \
    }                                                                                     \
    release(&j.q);                                                                        \
    return rc;

/* Q4_K form (packed_linear.c's steploop_packed_linear_q4k arguments) */
int steploop_int8_linear_q4k(float *y, const float *x, const uint8_t *qs, const float *dd, const uint8_t *scales,
                             int64_t M, int64_t N, int64_t K, int num_threads)
{
    DRIVE(0)
}

/* Q6_K form (packed_linear.c's steploop_packed_linear_kquant arguments with q6 = 1) */
int steploop_int8_linear_q6k(float *y, const float *x, const uint8_t *qs, const float *dd, const uint8_t *scales,
                             int64_t M, int64_t N, int64_t K, int num_threads)
{
    DRIVE(1)
}
