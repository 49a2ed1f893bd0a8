/* y = x @ W.T for GGUF Q4_K, Q6_K, Q4_1 and Q8_0 weights (packed_linear.c's forms) with int8 activations: opt-in,
   NOT exact.

   The exact kernels (packed_linear.c) multiply fp32 x by the file's dequantized fp32 weights: ~9 vector
   instructions per 16 weights in the one-row kernel, which on an AVX2 CPU makes a one-stream decode compute-bound
   at ~1.8x the memory-bandwidth bound. llama.cpp instead rounds x to int8 and multiplies in integers (maddubs: 32
   byte products a instruction). This file does the same for the two types of a Q4_K_M file, when
   steploop_set_int8_activations(1) was called (the worker's --cpu-int8-activations):

     x, per row and block of 32 along K:  dx = max|x| / 127, xq = roundf(x / dx) in -127..127 (llama.cpp's Q8_0
                                          rule), and the sums of xq per 16
     Q4_K, sub-block b (32 k):            y += dx * ((d sc) * sum(q xq) - (dmin mn) * sum(xq))
     Q6_K, sub-blocks j, j+1 (16 k each): y += dx * ((d sc_j) * sum_j((q - 32) xq) + (d sc_j+1) * sum_j+1(...))
     Q4_1, block b (32 k):                y += dx * (d * sum(q xq) + m * sum(xq))
     Q8_0, block b (32 k):                y += dx * (d * sum(q xq))
   (Q4_1 and Q8_0 are the default model's forms: its layers and its tied embedding / lm_head.)

   The integer sums are exact; the float epilogue is the same sequence of roundings (one multiply, then fmas) in the
   AVX2 and the portable code, so both builds give the same bits, and each output row's result depends only on its
   own x row: batch invariant, as the exact kernels are. What differs from the fp32 reference is x's rounding to 8
   bits: ~0.4% relative error per product, the error llama.cpp's outputs carry.

   Layout (packed_linear.c): per group of 16 output rows, qs uint8 [N/16][K/2][16] (byte = q(k even) | q(k odd)
   << 4). A 32-byte load holds two k pairs of 16 rows; unpacking its low and high nibbles byte by byte gives each
   row's (k, k+1) as adjacent bytes, which maddubs multiplies by (xq[k], xq[k+1]) and adds: 16 rows x 4 k in ~10
   instructions.

   With AVX-512 VNNI and VBMI (Zen 4, Ice Lake and later; the host build, -march=native): a 64-byte load holds 4 k
   pairs of the 16 rows; one vpermb gathers each row's 4 bytes into its own 32-bit lane, its low and high nibbles
   are that row's 4 even and 4 odd k, and one vpdpbusd each adds their products with the 4 even / 4 odd xq into
   the row's int32 sum: 16 rows x 8 k in 6 instructions. A thread takes two groups (32 outputs) and 4 x rows at a
   time: each group's 32-k block is unpacked once for the 4 rows, each row's x broadcast once for both groups, and
   the 8 sums stay in registers across K (2 vpdpbusd per row, group and 8 k). xq is stored reordered for it (per
   8 k: the 4 even, then the 4 odd). The sums are the same integers, and the float epilogue the same roundings, so
   every build still gives the same bits. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define INT8_VNNI 1
#else
#define INT8_VNNI 0
#endif

#define G 16
#define QK 32
#define QK_K 256
#define ROWS 64          /* x rows per pass over a group's weights (their 16 accumulators each stay on the stack) */

int steploop_int8_activations_on = 0;

void steploop_set_int8_activations(int on) { steploop_int8_activations_on = !!on; }

int steploop_int8_activations(void) { return steploop_int8_activations_on; }

/* One block of 32 x -> its 32 xq, dx and the two sums of 16 xq. xq = roundf(x * (1 / dx)), half away from zero;
   the AVX-512 form rounds as roundf does (trunc, then + 1 where the dropped fraction is >= 0.5: exact below 2^23),
   so every build gives the same bytes. */
static inline void quantize_block(const float *xb, int8_t *qb, float *dx, int32_t s[2])
{
#if defined(__AVX512F__)
    const __m512 sign = _mm512_set1_ps(-0.0f), half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    __m512 vid = _mm512_set1_ps(id);
    for (int h = 0; h < 2; h++) {
        __m512 v = _mm512_mul_ps(h ? v1 : v0, vid);
        __m512 a = _mm512_andnot_ps(sign, v);
        __m512 t = _mm512_roundscale_ps(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        t = _mm512_mask_add_ps(t, _mm512_cmp_ps_mask(_mm512_sub_ps(a, t), half, _CMP_GE_OQ), t, one);
        t = _mm512_min_ps(t, _mm512_set1_ps(127.0f));
        __m512i q = _mm512_cvttps_epi32(_mm512_or_ps(t, _mm512_and_ps(v, sign)));
        _mm_storeu_si128((__m128i *)(qb + 16 * h), _mm512_cvtsepi32_epi8(q));
        s[h] = _mm512_reduce_add_epi32(q);
    }
    *dx = d;
#else
    float amax = 0.0f;
    for (int k = 0; k < QK; k++)
        amax = fmaxf(amax, fabsf(xb[k]));
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    s[0] = s[1] = 0;
    for (int k = 0; k < QK; k++) {
        float v = roundf(xb[k] * id);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        qb[k] = (int8_t)v;
        s[k / 16] += qb[k];
    }
    *dx = d;
#endif
#if INT8_VNNI
    for (int k8 = 0; k8 < QK; k8 += 8) {            /* per 8 k: the 4 even, then the 4 odd (the sums' x order) */
        int8_t t[8];
        for (int c = 0; c < 4; c++) {
            t[c] = qb[k8 + 2 * c];
            t[4 + c] = qb[k8 + 2 * c + 1];
        }
        memcpy(qb + k8, t, 8);
    }
#endif
}

/* x [M, K] -> xq int8 [M, K], dx [M, K/32], xs int32 [M, K/16] (sums of xq per 16); blocks split over the
   threads (one thread left it the slowest part of a 16-row call, the others spinning) */
static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, int32_t *xs,
                          int num_threads)
{
    int64_t per_row = K / QK, total = M * per_row;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (total >= 256)
    for (int64_t i = 0; i < total; i++) {
        int64_t r = i / per_row, b = i % per_row;
        int32_t s[2];
        quantize_block(x + r * K + b * QK, xq + r * K + b * QK, dx + i, s);
        xs[2 * i] = s[0];
        xs[2 * i + 1] = s[1];
    }
}

/* ---- integer sums over 32 (Q4_K) or 16 (Q6_K) k of one group's 16 rows against one x row ---- */

#if INT8_VNNI
/* lane i's byte c <- byte 16 c + i: the 4 k pairs of row i, one per 16-byte chunk, side by side */
static inline __m512i rows_to_lanes(__m512i v)
{
    const __m512i idx = _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12,
                                        59, 43, 27, 11, 58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8,
                                        55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52, 36, 20, 4,
                                        51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
    return _mm512_permutexvar_epi8(idx, v);
}

/* acc += the 4 even k (low nibbles / lo) times xr[0..3] + the 4 odd k (hi) times xr[4..7], per row's lane */
static inline __m512i dot8(__m512i acc, __m512i lo, __m512i hi, const int8_t *xr)
{
    int32_t even, odd;
    memcpy(&even, xr, 4);
    memcpy(&odd, xr + 4, 4);
    acc = _mm512_dpbusd_epi32(acc, lo, _mm512_set1_epi32(even));
    return _mm512_dpbusd_epi32(acc, hi, _mm512_set1_epi32(odd));
}

/* A 32-k block of the group's 16 rows, unpacked once and used by every x row: per 8 k (j = 0..3), the 4 even k
   (lo) and the 4 odd k (hi) of each row in its lane. Q6_K values carry their two high bits (0..63). */
typedef struct {
    __m512i lo[4], hi[4];
} unpacked;

static inline void q4_unpack(const uint8_t *qs, unpacked *w)
{
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        __m512i v = rows_to_lanes(_mm512_loadu_si512((const void *)(qs + j * 64)));
        w->lo[j] = _mm512_and_si512(v, m4);
        w->hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
}

static inline void q6_unpack(const uint8_t *lo_qs, const uint8_t *hb, unpacked *w)
{
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3);
    /* chunk c (k pair 4 j + c) takes the high-bit byte of quad 2 j + c / 2, shifted by 4 (c % 2): the even k of
       the pair then sit in bits 0-1, the odd in bits 2-3 */
    const __m512i quad = _mm512_set_epi8(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                         31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                         15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0,
                                         15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i shift = _mm512_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0,
                                           4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int j = 0; j < 4; j++) {
        __m512i v = _mm512_loadu_si512((const void *)(lo_qs + j * 64));
        __m512i h = _mm512_permutexvar_epi8(quad, _mm512_castsi256_si512(
            _mm256_loadu_si256((const __m256i *)(hb + j * 32))));
        h = _mm512_srlv_epi16(h, shift);
        __m512i even = _mm512_or_si512(_mm512_and_si512(v, m4), _mm512_slli_epi16(_mm512_and_si512(h, m2), 4));
        __m512i odd = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4),
                                      _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2), m2), 4));
        w->lo[j] = rows_to_lanes(even);
        w->hi[j] = rows_to_lanes(odd);
    }
}

/* Q8_0's [32 k][16 rows] int8 block: per 8 k, lane i takes row i's 4 even k (lo) and 4 odd k (hi) from two 64-byte
   loads (4 k each), as unsigned q + 128 for vpdpbusd (the sum is corrected by 128 sum(xq)) */
#define Q8_EVEN(i) i, 32 + i, 64 + i, 96 + i
#define Q8_ODD(i) 16 + i, 48 + i, 80 + i, 112 + i
#define Q8_LANES(F) F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), F(8), F(9), F(10), F(11), F(12), F(13), F(14), F(15)
static const uint8_t q8_even_idx[64] = {Q8_LANES(Q8_EVEN)}, q8_odd_idx[64] = {Q8_LANES(Q8_ODD)};

static inline void q8_unpack(const int8_t *qs, unpacked *w)
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i even = _mm512_loadu_si512((const void *)q8_even_idx), odd = _mm512_loadu_si512((const void *)q8_odd_idx);
    for (int j = 0; j < 4; j++) {
        __m512i a = _mm512_loadu_si512((const void *)(qs + j * 128)), b = _mm512_loadu_si512((const void *)(qs + j * 128 + 64));
        w->lo[j] = _mm512_xor_si512(_mm512_permutex2var_epi8(a, even, b), flip);
        w->hi[j] = _mm512_xor_si512(_mm512_permutex2var_epi8(a, odd, b), flip);
    }
}

/* lane row = sum over the unpacked steps j0 .. j0 + n - 1 (8 k each) of q[row, k] * xq[k]; xq reordered */
static inline __m512i unpacked_sums(const unpacked *w, int j0, int n, const int8_t *xq)
{
    __m512i acc = _mm512_setzero_si512();
    for (int j = j0; j < j0 + n; j++)
        acc = dot8(acc, w->lo[j], w->hi[j], xq + 8 * (j - j0));
    return acc;
}
#elif defined(__AVX2__)
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

/* sum over k in [k0, k0 + 32) of q[row, k] * xq[k] for 16 rows (Q8_0: q int8 [k][16]); maddubs takes |q| and
   xq with q's sign (int16 lanes hold <= 2 * 128 * 127 = 32512) */
static inline void q8_sums(const int8_t *qs, const int8_t *xq, int32_t out[G])
{
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (int k = 0; k < QK; k += 2) {
        __m128i wk = _mm_loadu_si128((const __m128i *)(qs + k * G)), wk1 = _mm_loadu_si128((const __m128i *)(qs + (k + 1) * G));
        __m256i w = _mm256_set_m128i(_mm_unpackhi_epi8(wk, wk1), _mm_unpacklo_epi8(wk, wk1));   /* rows' (k, k+1) */
        __m256i xv = _mm256_set1_epi16((short)((uint8_t)xq[k] | ((uint16_t)(uint8_t)xq[k + 1] << 8)));
        __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
        a0 = _mm256_add_epi32(a0, _mm256_cvtepi16_epi32(_mm256_castsi256_si128(p)));
        a1 = _mm256_add_epi32(a1, _mm256_cvtepi16_epi32(_mm256_extracti128_si256(p, 1)));
    }
    _mm256_storeu_si256((__m256i *)out, a0);
    _mm256_storeu_si256((__m256i *)(out + 8), a1);
}
#else
static inline void q8_sums(const int8_t *qs, const int8_t *xq, int32_t out[G])
{
    for (int i = 0; i < G; i++)
        out[i] = 0;
    for (int k = 0; k < QK; k++)
        for (int i = 0; i < G; i++)
            out[i] += qs[k * G + i] * xq[k];
}

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
/* acc[i] = fma(a[i] * s[i] + b[i] * c, dx, acc[i]) for the 16 rows (Q4_1: a = d, b = m, c = sum xq; Q4_K: a = d sc,
   b = dmin mn, c = -sum xq, exactly the fnmadd of b * sum xq; Q8_0: b NULL, no second term) */
static inline void q4_epilogue(float *acc, const float *a, const float *b, const int32_t *s, float c, float dx)
{
    for (int h = 0; h < G; h += 8) {
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(a + h), _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(s + h))));
        if (b)
            t = _mm256_fmadd_ps(_mm256_loadu_ps(b + h), _mm256_set1_ps(c), t);
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
        if (b)
            t = fmaf(b[i], c, t);
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

static int quantize(const float *x, int64_t M, int64_t K, quantized_x *q, int num_threads)
{
    q->xq = malloc((size_t)(M * K));
    q->dx = malloc((size_t)(M * (K / QK)) * sizeof(float));
    q->xs = malloc((size_t)(M * (K / 16)) * sizeof(int32_t));
    if (!q->xq || !q->dx || !q->xs)
        return -1;
    quantize_rows(x, M, K, q->xq, q->dx, q->xs, num_threads);
    return 0;
}

static void release(quantized_x *q)
{
    free(q->xq);
    free(q->dx);
    free(q->xs);
}

enum { FORM_Q4K = 0, FORM_Q6K = 1, FORM_Q4_1 = 2, FORM_Q8_0 = 3 };

/* One call's arrays and its quantized x */
typedef struct {
    float *y;
    const uint8_t *qs, *sc, *mn, *qh;
    const float *d, *dmin;            /* Q4_1: d and m per 32 (m in dmin); Q8_0: d per 32 */
    int64_t M, N, K;
    quantized_x q;
} job;

static int job_start(job *j, float *y, const float *x, const uint8_t *qs, const float *dd, const uint8_t *scales,
                     int64_t M, int64_t N, int64_t K, int num_threads)
{
    /* Q4_K: sc, mn uint8 per 32; d, dmin per 256. Q6_K: sc int8 per 16; d per 256; high bits after the nibbles */
    *j = (job){y, qs, scales, scales + N * (K / QK), qs + N * K / 2, dd, dd + N * (K / QK_K), M, N, K,
               {NULL, NULL, NULL}};
    if (M < 0 || N <= 0 || K <= 0 || N % G || K % QK_K)
        return -1;
    return M == 0 ? 0 : quantize(x, M, K, &j->q, num_threads);
}

/* Q4_1 (d, m per 32) and Q8_0 (d per 32, m NULL): blocks of 32, any K that is a multiple of 32 */
static int job_start_32(job *j, float *y, const float *x, const uint8_t *qs, const float *d, const float *m,
                        int64_t M, int64_t N, int64_t K, int num_threads)
{
    *j = (job){y, qs, NULL, NULL, NULL, d, m, M, N, K, {NULL, NULL, NULL}};
    if (M < 0 || N <= 0 || K <= 0 || N % G || K % QK)
        return -1;
    return M == 0 ? 0 : quantize(x, M, K, &j->q, num_threads);
}

#if INT8_VNNI
/* d[i] * scale[i] for the 16 rows in one register (int8 scales when is_signed, else uint8): exact products */
static inline __m512 scales16(const float *d, const int8_t *scale, int is_signed)
{
    __m128i b = _mm_loadu_si128((const __m128i *)scale);
    __m512i i32 = is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
    return _mm512_mul_ps(_mm512_loadu_ps(d), _mm512_cvtepi32_ps(i32));
}

/* RT x rows (r0 ..) of GT groups (g0 ..) over all of K, each row's 16 outputs per group in a register across the
   blocks: a block is unpacked once for the RT rows, and each row's x is read once for the GT groups. The float
   epilogue is group_rows' sequence of roundings (mul, fmadd, fmadd), 16 lanes at once, so the outputs
   are the same bits as the other builds'. */
static inline __attribute__((always_inline)) void vnni_tile(int form, const job *j, int64_t g0, int GT, int64_t r0,
                                                            int RT)
{
    int64_t K = j->K;
    __m512 acc[2][4];
    for (int gi = 0; gi < GT; gi++)
        for (int r = 0; r < RT; r++)
            acc[gi][r] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < K / QK; blk++) {
        __m512 a0[2], a1[2];
        unpacked w[2];
        for (int gi = 0; gi < GT; gi++) {
            int64_t g = g0 + gi;
            const uint8_t *lo = j->qs + (g * (K / 2) + blk * (QK / 2)) * G;
            if (form == FORM_Q4_1 || form == FORM_Q8_0) {
                a0[gi] = _mm512_loadu_ps(j->d + (g * (K / QK) + blk) * G);
                if (form == FORM_Q4_1) {
                    a1[gi] = _mm512_loadu_ps(j->dmin + (g * (K / QK) + blk) * G);
                    q4_unpack(lo, &w[gi]);
                } else {
                    q8_unpack((const int8_t *)j->qs + (g * K + blk * QK) * G, &w[gi]);
                }
                continue;
            }
            const float *dg = j->d + (g * (K / QK_K) + blk / (QK_K / QK)) * G;
            if (form == FORM_Q6K) {
                const int8_t *scg = (const int8_t *)j->sc + (g * (K / 16) + 2 * blk) * G;
                a0[gi] = scales16(dg, scg, 1);
                a1[gi] = scales16(dg, scg + G, 1);
                q6_unpack(lo, j->qh + (g * (K / 4) + blk * (QK / 4)) * G, &w[gi]);
            } else {
                const float *mg = j->dmin + (g * (K / QK_K) + blk / (QK_K / QK)) * G;
                a0[gi] = scales16(dg, (const int8_t *)j->sc + (g * (K / QK) + blk) * G, 0);
                a1[gi] = scales16(mg, (const int8_t *)j->mn + (g * (K / QK) + blk) * G, 0);
                q4_unpack(lo, &w[gi]);
            }
        }
        for (int r = 0; r < RT; r++) {
            int64_t row = r0 + r;
            const int8_t *xb = j->q.xq + row * K + blk * QK;
            const int32_t *xs = j->q.xs + row * (K / 16) + 2 * blk;
            __m512 dx = _mm512_set1_ps(j->q.dx[row * (K / QK) + blk]);
            for (int gi = 0; gi < GT; gi++) {
                __m512 t;
                if (form == FORM_Q6K) {                 /* (q - 32) xq summed: exact in int32 */
                    __m512i s0 = _mm512_sub_epi32(unpacked_sums(&w[gi], 0, 2, xb), _mm512_set1_epi32(32 * xs[0]));
                    __m512i s1 = _mm512_sub_epi32(unpacked_sums(&w[gi], 2, 2, xb + 16),
                                                  _mm512_set1_epi32(32 * xs[1]));
                    t = _mm512_fmadd_ps(a1[gi], _mm512_cvtepi32_ps(s1), _mm512_mul_ps(a0[gi], _mm512_cvtepi32_ps(s0)));
                } else if (form == FORM_Q8_0) {         /* (q + 128) xq summed, less 128 sum(xq): exact */
                    __m512i s0 = _mm512_sub_epi32(unpacked_sums(&w[gi], 0, 4, xb),
                                                  _mm512_set1_epi32(128 * (xs[0] + xs[1])));
                    t = _mm512_mul_ps(a0[gi], _mm512_cvtepi32_ps(s0));
                } else {
                    float c = (float)(xs[0] + xs[1]);   /* Q4_K subtracts dmin mn sum xq, Q4_1 adds m sum xq */
                    t = _mm512_mul_ps(a0[gi], _mm512_cvtepi32_ps(unpacked_sums(&w[gi], 0, 4, xb)));
                    t = _mm512_fmadd_ps(a1[gi], _mm512_set1_ps(form == FORM_Q4_1 ? c : -c), t);
                }
                acc[gi][r] = _mm512_fmadd_ps(t, dx, acc[gi][r]);
            }
        }
    }
    for (int gi = 0; gi < GT; gi++)
        for (int r = 0; r < RT; r++)
            _mm512_storeu_ps(j->y + (r0 + r) * j->N + (g0 + gi) * G, acc[gi][r]);
}

/* Groups g0 .. g0 + GT - 1's outputs for every x row: 4 rows a tile, then one by one */
static inline __attribute__((always_inline)) void group_rows_vnni(int form, const job *j, int64_t g0, int GT)
{
    int64_t r0 = 0;
    for (; r0 + 4 <= j->M; r0 += 4)
        vnni_tile(form, j, g0, GT, r0, 4);
    for (; r0 < j->M; r0++)
        vnni_tile(form, j, g0, GT, r0, 1);
}
#else
/* Group g's 16 outputs for every x row, ROWS rows a pass (their accumulators on the stack). q6 picks the form, a
   constant: each driver's parallel loop inlines its own copy (1.4x faster at 16 rows than one loop deciding the
   form at run time; blocking several x rows on each unpacked step bought nothing more and cost 10% at one row).
   Each x row's outputs are its own integer sums and the same float epilogue, whatever M or the pass. */
static inline __attribute__((always_inline)) void group_rows(int form, const job *j, int64_t g)
{
    int64_t K = j->K;
    int q6 = form == FORM_Q6K, per32 = form == FORM_Q4_1 || form == FORM_Q8_0;
    float acc[ROWS][G], a0[G], a1[G];
    int32_t s0[G], s1[G];
    for (int64_t r0 = 0; r0 < j->M; r0 += ROWS) {
        int64_t rows = j->M - r0 < ROWS ? j->M - r0 : ROWS;
        memset(acc, 0, (size_t)rows * sizeof acc[0]);
        for (int64_t blk = 0; blk < K / QK; blk++) {
            const float *dg = per32 ? NULL : j->d + (g * (K / QK_K) + blk / (QK_K / QK)) * G;
            const float *d32 = j->d + (g * (K / QK) + blk) * G;                  /* Q4_1, Q8_0 */
            const float *m32 = form == FORM_Q4_1 ? j->dmin + (g * (K / QK) + blk) * G : NULL;
            if (q6) {                                /* d sc per 16: exact (11 x 8 significant bits) */
                const int8_t *scg = (const int8_t *)j->sc + (g * (K / 16) + 2 * blk) * G;
                scale_products(dg, scg, 1, a0);
                scale_products(dg, scg + G, 1, a1);
            } else if (!per32) {                     /* d sc and dmin mn per 32: exact (11 x 6 bits) */
                const float *mg = j->dmin + (g * (K / QK_K) + blk / (QK_K / QK)) * G;
                scale_products(dg, (const int8_t *)j->sc + (g * (K / QK) + blk) * G, 0, a0);
                scale_products(mg, (const int8_t *)j->mn + (g * (K / QK) + blk) * G, 0, a1);
            }
            const uint8_t *lo = j->qs + (g * (K / 2) + blk * (QK / 2)) * G;
            const uint8_t *hb = q6 ? j->qh + (g * (K / 4) + blk * (QK / 4)) * G : NULL;
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
                } else if (form == FORM_Q8_0) {
                    q8_sums((const int8_t *)j->qs + (g * K + blk * QK) * G, xb, s0);
                    q4_epilogue(acc[r], d32, NULL, s0, 0.0f, dx);
                } else if (form == FORM_Q4_1) {
                    q4_sums(lo, xb, s0);
                    q4_epilogue(acc[r], d32, m32, s0, (float)(xs[0] + xs[1]), dx);
                } else {
                    q4_sums(lo, xb, s0);
                    q4_epilogue(acc[r], a0, a1, s0, -(float)(xs[0] + xs[1]), dx);
                }
            }
        }
        for (int64_t r = 0; r < rows; r++)
            memcpy(j->y + (r0 + r) * j->N + g * G, acc[r], sizeof acc[r]);
    }
}
#endif

#if INT8_VNNI
/* Each thread takes pairs of groups (32 outputs: each x row read once for both), an odd last group alone */
#define FOR_GROUPS(Q6)                                                                    \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                 \
    for (int64_t p = 0; p < (N / G + 1) / 2; p++) {                                       \
        if (2 * p + 1 < N / G)                                                            \
            group_rows_vnni(Q6, &j, 2 * p, 2);                                            \
        else                                                                              \
            group_rows_vnni(Q6, &j, 2 * p, 1);                                            \
    }
#else
/* Each thread takes whole groups of 16 outputs */
#define FOR_GROUPS(Q6)                                                                    \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                 \
    for (int64_t g = 0; g < N / G; g++)                                                   \
        group_rows(Q6, &j, g);
#endif

#define DRIVE(FORM, START)                                                                \
    job j;                                                                                \
    int rc = START;                                                                       \
    if (rc == 0 && M > 0) {                                                               \
        FOR_GROUPS(FORM)                                                                  \
    }                                                                                     \
    release(&j.q);                                                                        \
    return rc;

/* Q4_K form (packed_linear.c's steploop_packed_linear_q4k arguments) */
int steploop_int8_linear_q4k(float *y, const float *x, const uint8_t *qs, const float *dd, const uint8_t *scales,
                             int64_t M, int64_t N, int64_t K, int num_threads)
{
    DRIVE(FORM_Q4K, job_start(&j, y, x, qs, dd, scales, M, N, K, num_threads))
}

/* Q6_K form (packed_linear.c's steploop_packed_linear_kquant arguments with q6 = 1) */
int steploop_int8_linear_q6k(float *y, const float *x, const uint8_t *qs, const float *dd, const uint8_t *scales,
                             int64_t M, int64_t N, int64_t K, int num_threads)
{
    DRIVE(FORM_Q6K, job_start(&j, y, x, qs, dd, scales, M, N, K, num_threads))
}

/* Q4_1 form (steploop_packed_linear's arguments, kind Q4_1) */
int steploop_int8_linear_q4_1(float *y, const float *x, const uint8_t *qs, const float *d, const float *m,
                              int64_t M, int64_t N, int64_t K, int num_threads)
{
    DRIVE(FORM_Q4_1, job_start_32(&j, y, x, qs, d, m, M, N, K, num_threads))
}

/* Q8_0 form (steploop_packed_linear's arguments, kind Q8_0) */
int steploop_int8_linear_q8_0(float *y, const float *x, const int8_t *qs, const float *d, int64_t M, int64_t N,
                              int64_t K, int num_threads)
{
    DRIVE(FORM_Q8_0, job_start_32(&j, y, x, (const uint8_t *)qs, d, NULL, M, N, K, num_threads))
}
