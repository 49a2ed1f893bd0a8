/* y = x @ W.T on the CPU in fp32, with W held in a lossless packed form of its block-quantized values.

   Checkpoints dequantized from GGUF (the default model's Q4_1 layers and Q8_0 embedding) hold fp32 weights that are
   exactly d * q + m per block of 32 along K. packed_weights.py recovers (d, m, q) and checks the round trip bit for
   bit, so this kernel multiplies by the very same fp32 weights while reading 6 (Q4_1) or 9 (Q8_0) bits per weight
   from memory instead of 32: at decode batch sizes the fp32 matmul is memory-bound on a small CPU.

   Layout, per group of 16 output rows (g = n / 16), so one 16-lane vector load yields 16 rows' values at one k:
     Q4_1: qs uint8 [N/16][K/2][16]: byte = q(k even) | q(k odd) << 4;  d, m float [N/16][K/32][16]
     Q8_0: qs int8  [N/16][K][16];                                       d      float [N/16][K/32][16]
   Dequantizing is exact: d * q is exact in fp32 since d is an fp16 value and |q| < 256, so the fused multiply-add
   rounds once, as numpy's d * q + m does. One or two rows (a lone decode) dequantize each VL-row slice of a group
   in registers and use it at once; larger batches dequantize a tile of NR output rows into an fp32 scratch, k
   chunk by k chunk, then MR x NR register blocks accumulate broadcast(x[r, k]) * scratch[k, :] over k.

   The vectors are as wide as the instruction set build.py compiles for (VL floats, vector_width.h: 16 with
   AVX-512, 8 with AVX2, 4 otherwise) and the blocking is sized to its registers (32 zmm, 16 ymm): 16-float generic
   vectors on AVX2 made gcc keep every accumulator on the stack, reloading it through general registers after each
   fma (~14x slower than torch at 64 rows). A VL-row slice of a 16-row group is a work item of its own.

   Every output y[r, n] is one fma chain over k = 0 .. K-1 in order, whatever M, the row's place in the batch, the
   register block it fell in or the vector width: a token's result does not depend on the rest of the batch, and
   the AVX2 and AVX-512 builds give the same bits. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_width.h"

#define QK 32    /* weights per quantization block along K */
#define G 16     /* output rows per layout group */
#define NR (2 * VL)   /* output rows per scratch tile (two vectors) */
/* k per scratch chunk: KC x NR floats (16 KiB) stay in L1 while every row block of the batch uses them; a whole
   [K][NR] tile (73 KiB at K = 576) came from L2 at every k (benchmarks/packed_linear.py: M = 64 ~265 GFLOP/s of a
   ~420 fma peak on 2 AVX-512 cores) */
#ifndef KC    /* build.py sets it (and X_BYTES) on a CPU not an Intel one: cpu_tuning.py */
#define KC (4096 / NR)
#endif
#if VL == 16
#define MR 8          /* x rows per register block: 16 accumulators of 32 zmm */
#else
#define MR 6          /* 12 accumulators + 2 weights + a broadcast in 16 ymm / xmm */
#endif
/* Batches up to this many rows dequantize in registers (no scratch); the scratch tile wins from 3 rows on
   (benchmarks/packed_linear.py, a whole forward's weights, 2 cores: AVX2 at 3 rows 13.9 vs 20.0 ms, at 16
   27.1 vs 33.4, at 48 66.1 vs 88.5; AVX-512 at 3 rows 10.3 vs 12.4, at 8 13.9 vs 17.4; at 1 row the register
   path wins, 8.3 vs 9.6 AVX-512, 10.6 vs 15.4 AVX2). It once went to 48 rows, before the tile was used in
   L1-sized k chunks. */
#ifndef REGISTER_MAX_M     /* build.py sets 4 where the scratch tile loses at 3-4 rows (cpu_tuning.py) */
#define REGISTER_MAX_M 2
#endif
#if REGISTER_MAX_M != 2 && REGISTER_MAX_M != 4
#error "REGISTER_MAX_M is 2 or 4"
#endif
/* CASE(F, R, S) for every row count R of the register paths and S = 1 .. NS slices side by side; F passes through */
#define ROWS_1_2(CASE, F)                                                           \
    CASE(F, 1, 1) CASE(F, 1, 2) CASE(F, 1, 3) CASE(F, 1, 4)                         \
    CASE(F, 2, 1) CASE(F, 2, 2) CASE(F, 2, 3) CASE(F, 2, 4)
#if REGISTER_MAX_M == 4
#define ROWS_SLICES(CASE, F)                                                        \
    ROWS_1_2(CASE, F)                                                               \
    CASE(F, 3, 1) CASE(F, 3, 2) CASE(F, 3, 3) CASE(F, 3, 4)                         \
    CASE(F, 4, 1) CASE(F, 4, 2) CASE(F, 4, 3) CASE(F, 4, 4)
#else
#define ROWS_SLICES(CASE, F) ROWS_1_2(CASE, F)
#endif
/* ... and for both values of a form's two-way flag (Q5_K / Q6_K, bf16 / fp16) */
#define FLAG_ROWS_SLICES(CASE) ROWS_SLICES(CASE, 0) ROWS_SLICES(CASE, 1)
/* x bytes per pass of the tile path over the weights: a pass's rows (X_BYTES / (4 K) of them, at most) stay in L2
   while every tile uses them. In one pass, 1024 rows re-read x (2.4-6.3 MB) from L3 for every tile: AVX2 at 1024
   rows 160 GFLOP/s in one pass, 214 in passes of <= 512 KB (1 MB: 202, 2 MB: 166); torch 184. */
#ifndef X_BYTES
#define X_BYTES (1 << 19)
#endif

enum { KIND_Q4_1 = 0, KIND_Q8_0 = 1 };

/* int8_activations.c: Q4_K, Q6_K, Q4_1 and Q8_0 with int8 activations, when the worker opted in (not exact) */
extern int steploop_int8_activations_on;
int steploop_int8_linear_q4_1(float *y, const float *x, const uint8_t *qs, const float *d, const float *m,
                              int64_t M, int64_t N, int64_t K, int num_threads);
int steploop_int8_linear_q8_0(float *y, const float *x, const int8_t *qs, const float *d, int64_t M, int64_t N,
                              int64_t K, int num_threads);
int steploop_int8_linear_q4k(float *y, const float *x, const uint8_t *qs, const float *dd, const uint8_t *scales,
                             int64_t M, int64_t N, int64_t K, int num_threads);
int steploop_int8_linear_q6k(float *y, const float *x, const uint8_t *qs, const float *dd, const uint8_t *scales,
                             int64_t M, int64_t N, int64_t K, int num_threads);

static inline vf loadv(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* VL bytes widened to VL int32 lanes. gcc scalarizes __builtin_convertvector from 8-bit lanes (dozens of byte
   inserts per vector, which made dequantizing ~4x slower), so the x86 widening instructions are spelled out. */
#if VL == 16
#include <immintrin.h>
static inline vi widen_u8(const uint8_t *p) { return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi widen_s8(const int8_t *p) { return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
#elif VL == 8
#include <immintrin.h>
static inline vi widen_u8(const uint8_t *p) { return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi widen_s8(const int8_t *p) { return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#elif defined(__SSE4_1__)
#include <immintrin.h>
static inline vi widen_u8(const uint8_t *p)
{
    int32_t w;
    memcpy(&w, p, 4);
    return (vi)_mm_cvtepu8_epi32(_mm_cvtsi32_si128(w));
}
static inline vi widen_s8(const int8_t *p)
{
    int32_t w;
    memcpy(&w, p, 4);
    return (vi)_mm_cvtepi8_epi32(_mm_cvtsi32_si128(w));
}
#else
static inline vi widen_u8(const uint8_t *p) { vi v; for (int i = 0; i < VL; i++) v[i] = p[i]; return v; }
static inline vi widen_s8(const int8_t *p) { vi v; for (int i = 0; i < VL; i++) v[i] = p[i]; return v; }
#endif

/* Slice s holds output rows [s * VL, s * VL + VL): layout group s * VL / G, lanes from (s * VL) % G. These give
   the offset (in elements) of its values at quantization block b, k pair k / 2 (Q4_1) or k (Q8_0). */
static inline int64_t scale_at(int64_t s, int64_t K, int64_t b) { return (s * VL / G * (K / QK) + b) * G + s * VL % G; }
static inline int64_t q4_at(int64_t s, int64_t K, int64_t k) { return (s * VL / G * (K / 2) + k / 2) * G + s * VL % G; }
static inline int64_t q8_at(int64_t s, int64_t K, int64_t k) { return (s * VL / G * K + k) * G + s * VL % G; }

/* dequantize slice s (VL rows), k in [k0, k0 + kc) (multiples of QK), into scratch columns [col, col + VL) of a
   [kc][NR] tile */
static void dequant_q4_1(const uint8_t *qs, const float *d, const float *m, int64_t s, int64_t K, int64_t k0,
                         int64_t kc, float *tile, int64_t col)
{
    for (int64_t b = k0 / QK; b < (k0 + kc) / QK; b++) {
        vf db = loadv(d + scale_at(s, K, b)), mb = loadv(m + scale_at(s, K, b));
        for (int64_t p = 0; p < QK / 2; p++) {
            int64_t k = b * QK + 2 * p;
            vi iv = widen_u8(qs + q4_at(s, K, k));
            storev(tile + (k - k0) * NR + col, __builtin_convertvector(iv & 15, vf) * db + mb);
            storev(tile + (k - k0 + 1) * NR + col, __builtin_convertvector(iv >> 4, vf) * db + mb);
        }
    }
}

static void dequant_q8_0(const int8_t *qs, const float *d, int64_t s, int64_t K, int64_t k0, int64_t kc,
                         float *tile, int64_t col)
{
    for (int64_t b = k0 / QK; b < (k0 + kc) / QK; b++) {
        vf db = loadv(d + scale_at(s, K, b));
        for (int64_t j = 0; j < QK; j++) {
            int64_t k = b * QK + j;
            storev(tile + (k - k0) * NR + col, __builtin_convertvector(widen_s8(qs + q8_at(s, K, k)), vf) * db);
        }
    }
}

/* Ask for bytes [p, p + n) in cache (each 64-byte line once). */
static inline void prefetch_range(const void *p, int64_t n)
{
    for (int64_t i = 0; i < n; i += 64)
        __builtin_prefetch((const char *)p + i, 0, 1);
}

/* Prefetch slice s's packed values and scales for k in [k0, k0 + kc), to be asked for one chunk or slice ahead:
   they then arrive from memory while the current one computes instead of stalling its dequantizing (which had
   cost ~14% of the tile path's time at 64 rows, weights from DRAM). */
static void prefetch_chunk(int kind, const void *qs, const float *d, const float *m, int64_t s, int64_t K,
                           int64_t k0, int64_t kc)
{
    int64_t b0 = k0 / QK, nb = kc / QK;
    prefetch_range(d + scale_at(s, K, b0), ((nb - 1) * G + VL) * 4);
    if (kind == KIND_Q4_1) {
        prefetch_range(m + scale_at(s, K, b0), ((nb - 1) * G + VL) * 4);
        prefetch_range((const uint8_t *)qs + q4_at(s, K, k0), (kc / 2 - 1) * G + VL);
    } else {
        prefetch_range((const int8_t *)qs + q8_at(s, K, k0), (kc - 1) * G + VL);
    }
}

/* the k length of the chunk that starts at k0 */
static inline int64_t chunk_len(int64_t K, int64_t k0) { return K - k0 < KC ? K - k0 : KC; }

/* the slices (1 or 2) of scratch tile t, of num_slices */
static inline int tile_slices(int64_t num_slices, int64_t t) { return num_slices - t * 2 >= 2 ? 2 : 1; }

/* y[r, 0:VL*nv] (+)= sum_k x[r, k] * tile[k, 0:VL*nv] for r < mr, k < kc (x's rows K apart); `first` starts
   from zero, else from y's partial sums of the chunks before, so each output stays one fma chain over k in order.
   mr and nv are constants after inlining. */
static inline __attribute__((always_inline)) void block(int mr, int nv, const float *restrict x, int64_t K,
                                                        int64_t kc, const float *restrict tile, float *restrict y,
                                                        int64_t N, int first)
{
    vf acc[MR][2];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++)
            acc[r][v] = first ? (vf){0} : loadv(y + r * N + v * VL);
    for (int64_t k = 0; k < kc; k++) {
        vf w0 = loadv(tile + k * NR), w1 = nv > 1 ? loadv(tile + k * NR + VL) : (vf){0};
        for (int r = 0; r < mr; r++) {
            float xv = x[r * K + k];
            acc[r][0] += xv * w0;
            if (nv > 1)
                acc[r][1] += xv * w1;
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++)
            storev(y + r * N + v * VL, acc[r][v]);
}

#define BLOCK_CASE(R)                                             \
    case R:                                                       \
        if (nv == 2)                                              \
            block(R, 2, x, K, kc, tile, y, N, first);             \
        else                                                      \
            block(R, 1, x, K, kc, tile, y, N, first);             \
        break;

static void block_dispatch(int mr, int nv, const float *x, int64_t K, int64_t kc, const float *tile, float *y,
                           int64_t N, int first)
{
    switch (mr) {
        BLOCK_CASE(1) BLOCK_CASE(2) BLOCK_CASE(3) BLOCK_CASE(4) BLOCK_CASE(5) BLOCK_CASE(6)
#if MR > 6
        BLOCK_CASE(7) BLOCK_CASE(8)
#endif
    }
}

/* Up to REGISTER_MAX_M rows of a Q8_0 matrix (the lm_head of a lone decode): no scratch; each slice of VL output
   rows is dequantized in registers, one k at a time, and used at once. x comes transposed (xt[k][r], see
   steploop_packed_linear) so all rows broadcast from one pointer. This path streams the weights at memory speed
   already; Q4_1 takes the side-by-side path below. */
static inline __attribute__((always_inline)) void fused_q8_0(int mr, const float *restrict xt, int64_t K,
                                                             const int8_t *restrict qs, const float *restrict d,
                                                             int64_t s, float *restrict y, int64_t N)
{
    vf acc[REGISTER_MAX_M];
    for (int r = 0; r < mr; r++)
        acc[r] = (vf){0};
    for (int64_t b = 0; b < K / QK; b++) {
        vf db = loadv(d + scale_at(s, K, b));
        for (int64_t i = 0; i < QK; i++) {
            int64_t k = b * QK + i;
            vf w = __builtin_convertvector(widen_s8(qs + q8_at(s, K, k)), vf) * db;
            for (int r = 0; r < mr; r++)
                acc[r] += xt[k * mr + r] * w;
        }
    }
    for (int r = 0; r < mr; r++)
        storev(y + r * N + s * VL, acc[r]);
}

/* Up to REGISTER_MAX_M rows of a Q4_1 matrix (a lone decode): each output's fma chain is ~2 * K dependent fmas, so
   one slice at a time waited on fma latency and on its loads (weights read at ~6 GB/s at one row). Here NS slices
   advance side by side: NS * rows independent chains, each still one chain over k in order. ns and mr are
   constants after inlining. */
#define NS 4
static inline __attribute__((always_inline)) void fused_q4_1_side(int mr, int ns, const float *restrict xt,
                                                                  int64_t K, const uint8_t *restrict qs,
                                                                  const float *restrict d,
                                                                  const float *restrict m, int64_t s0,
                                                                  float *restrict y, int64_t N)
{
    vf acc[NS][REGISTER_MAX_M];
    for (int i = 0; i < ns; i++)
        for (int r = 0; r < mr; r++)
            acc[i][r] = (vf){0};
    for (int64_t b = 0; b < K / QK; b++) {
        vf db[NS], mb[NS];
        for (int i = 0; i < ns; i++) {
            db[i] = loadv(d + scale_at(s0 + i, K, b));
            mb[i] = loadv(m + scale_at(s0 + i, K, b));
        }
        for (int64_t p = 0; p < QK / 2; p++) {
            int64_t k = b * QK + 2 * p;
            for (int i = 0; i < ns; i++) {
                vi iv = widen_u8(qs + q4_at(s0 + i, K, k));
                vf w0 = __builtin_convertvector(iv & 15, vf) * db[i] + mb[i];
                vf w1 = __builtin_convertvector(iv >> 4, vf) * db[i] + mb[i];
                for (int r = 0; r < mr; r++)
                    acc[i][r] += xt[k * mr + r] * w0;
                for (int r = 0; r < mr; r++)
                    acc[i][r] += xt[(k + 1) * mr + r] * w1;
            }
        }
    }
    for (int i = 0; i < ns; i++)
        for (int r = 0; r < mr; r++)
            storev(y + r * N + (s0 + i) * VL, acc[i][r]);
}

static void fused_q4_1_side_dispatch(int mr, int ns, const float *xt, int64_t K, const uint8_t *qs,
                                     const float *d, const float *m, int64_t s0, float *y, int64_t N)
{
#define SIDE_CASE(F, R, S)                                                \
    if (mr == R && ns == S) {                                             \
        fused_q4_1_side(R, S, xt, K, qs, d, m, s0, y, N);                 \
        return;                                                           \
    }
    ROWS_SLICES(SIDE_CASE, 0)
#undef SIDE_CASE
}

/* The calling thread's buffer `slot` (0: x transposed, 1: the scratch tile), grown as needed and kept for the next
call: this runs ~120 times a step, and a fresh ~200 KB tile per call came from mmap with its page faults. NULL
when out of memory. */
static float *thread_buffer(int slot, int64_t n)
{
    static __thread float *buf[2];
    static __thread int64_t cap[2];
    if (n > cap[slot]) {
        free(buf[slot]);
        cap[slot] = (n + 4095) & ~(int64_t)4095;
        buf[slot] = aligned_alloc(64, (size_t)cap[slot] * sizeof(float));
        if (!buf[slot])
            cap[slot] = 0;
    }
    return buf[slot];
}

/* x [M, K], y [M, N] fp32 row-major; N % 16 == 0, K % 32 == 0. Returns 0, or -1 on bad sizes or no memory. */
/* x transposed into this thread's buffer 0 ([K][M]), for the register path's broadcasts; one row is its own.
   NULL when the buffer cannot be had. */
static const float *transposed_x(const float *x, int64_t M, int64_t K)
{
    if (M == 1)
        return x;
    float *buf = thread_buffer(0, M * K);
    if (!buf)
        return NULL;
    for (int64_t k = 0; k < K; k++)
        for (int64_t r = 0; r < M; r++)
            buf[k * M + r] = x[r * K + k];
    return buf;
}

/* One packed weight as the tile path reads it: its form and the arrays that form has. */
enum { TILE_Q4_1, TILE_Q8_0, TILE_Q8B, TILE_Q4K, TILE_Q5K, TILE_Q6K, TILE_BF16, TILE_F16 };
typedef struct {
    int form;
    const void *qs;
    const float *d, *m;              /* Q4_1, Q8_0 (no m), q8b (m may be NULL); Q4_K: d per 256 */
    int bs;                          /* q8b: weights per scale (16 or 32) */
    const uint8_t *sc, *mn;          /* Q4_K: 6-bit scales and mins per 32 */
    const float *dmin;               /* Q4_K, Q5_K: dmin per 256 */
    const uint8_t *qh;               /* Q5_K: fifth bits, Q6_K: fifth and sixth bits (planes after the nibbles) */
} tile_weight;

static void dequant_q8b_dispatch(int bs, const int8_t *qs, const float *d, const float *m, int64_t s, int64_t K,
                                 int64_t k0, int64_t kc, float *tile, int64_t col);
static void prefetch_q8b(const int8_t *qs, const float *d, const float *m, int bs, int64_t s, int64_t K, int64_t k0,
                         int64_t kc);
static void dequant_q4k(const uint8_t *qs, const uint8_t *sc, const uint8_t *mn, const float *d, const float *dmin,
                        int64_t s, int64_t K, int64_t k0, int64_t kc, float *tile, int64_t col);
static void prefetch_q4k(const uint8_t *qs, const uint8_t *sc, const uint8_t *mn, int64_t s, int64_t K, int64_t k0,
                         int64_t kc);
static void dequant_q5k(const tile_weight *w, int64_t s, int64_t K, int64_t k0, int64_t kc, float *tile, int64_t col);
static void dequant_q6k(const tile_weight *w, int64_t s, int64_t K, int64_t k0, int64_t kc, float *tile, int64_t col);
static void prefetch_q5k(const tile_weight *w, int64_t s, int64_t K, int64_t k0, int64_t kc);
static void prefetch_q6k(const tile_weight *w, int64_t s, int64_t K, int64_t k0, int64_t kc);
static void dequant_w16(int f16, const uint16_t *w, int64_t s, int64_t K, int64_t k0, int64_t kc, float *tile,
                        int64_t col);
static void prefetch_w16(const uint16_t *w, int64_t s, int64_t K, int64_t k0, int64_t kc);

/* slice s's weights for k0 .. k0 + kc into the tile at column col */
static inline void tile_dequant(const tile_weight *w, int64_t s, int64_t K, int64_t k0, int64_t kc, float *tile,
                                int64_t col)
{
    switch (w->form) {
    case TILE_Q4_1: dequant_q4_1(w->qs, w->d, w->m, s, K, k0, kc, tile, col); break;
    case TILE_Q8_0: dequant_q8_0(w->qs, w->d, s, K, k0, kc, tile, col); break;
    case TILE_Q8B: dequant_q8b_dispatch(w->bs, w->qs, w->d, w->m, s, K, k0, kc, tile, col); break;
    case TILE_Q4K: dequant_q4k(w->qs, w->sc, w->mn, w->d, w->dmin, s, K, k0, kc, tile, col); break;
    case TILE_Q5K: dequant_q5k(w, s, K, k0, kc, tile, col); break;
    case TILE_BF16: case TILE_F16: dequant_w16(w->form == TILE_F16, w->qs, s, K, k0, kc, tile, col); break;
    default: dequant_q6k(w, s, K, k0, kc, tile, col); break;
    }
}

static inline void tile_prefetch(const tile_weight *w, int64_t s, int64_t K, int64_t k0, int64_t kc)
{
    switch (w->form) {
    case TILE_Q4_1: prefetch_chunk(KIND_Q4_1, w->qs, w->d, w->m, s, K, k0, kc); break;
    case TILE_Q8_0: prefetch_chunk(KIND_Q8_0, w->qs, w->d, w->m, s, K, k0, kc); break;
    case TILE_Q8B: prefetch_q8b(w->qs, w->d, w->m, w->bs, s, K, k0, kc); break;
    case TILE_Q4K: prefetch_q4k(w->qs, w->sc, w->mn, s, K, k0, kc); break;
    case TILE_Q5K: prefetch_q5k(w, s, K, k0, kc); break;
    case TILE_BF16: case TILE_F16: prefetch_w16(w->qs, s, K, k0, kc); break;
    default: prefetch_q6k(w, s, K, k0, kc); break;
    }
}

/* The scratch-tile path for M > REGISTER_MAX_M rows, every form alike: each tile (two slices of VL output rows)
   is dequantized one k chunk at a time into an L1-sized tile and multiplied by register blocks of x rows. */
static int tile_matmul(float *y, const float *x, int64_t M, int64_t N, int64_t K, const tile_weight *w,
                       int num_threads)
{
    int64_t num_slices = N / VL, num_tiles = (num_slices + 1) / 2;
    /* rows per pass over the tiles: their x (mc x K floats) stays in L2 while every tile uses it */
    int64_t mc = X_BYTES / (K * (int64_t)sizeof(float)) / MR * MR;
    mc = mc < MR ? MR : mc;
    int64_t passes = (M + mc - 1) / mc;
    mc = ((M + passes - 1) / passes + MR - 1) / MR * MR;      /* even passes, whole register blocks */
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *tile = thread_buffer(1, KC * NR);
        if (!tile)
            failed = 1;
        for (int64_t m0 = 0; m0 < M; m0 += mc) {
            int64_t m1 = M - m0 < mc ? M : m0 + mc;
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < num_tiles; t++) {
                if (!tile)
                    continue;
                int nv = tile_slices(num_slices, t);
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    int64_t kc = chunk_len(K, k0);
                    for (int v = 0; v < nv; v++)
                        tile_dequant(w, t * 2 + v, K, k0, kc, tile, v * VL);
                    /* the next chunk: this tile's further along k, else the next tile's first (static schedule:
                       usually this thread's next) */
                    int64_t next_t = k0 + KC < K ? t : t + 1, next_k0 = k0 + KC < K ? k0 + KC : 0;
                    if (next_t < num_tiles)
                        for (int v = 0; v < tile_slices(num_slices, next_t); v++)
                            tile_prefetch(w, next_t * 2 + v, K, next_k0, chunk_len(K, next_k0));
                    for (int64_t r = m0; r < m1; r += MR) {
                        int mr = m1 - r < MR ? (int)(m1 - r) : MR;
                        block_dispatch(mr, nv, x + r * K + k0, K, kc, tile, y + r * N + t * NR, N, k0 == 0);
                    }
                }
            }
        }
    }
    return failed ? -1 : 0;
}

/* The register path of a form with a side-by-side kernel (up to REGISTER_MAX_M rows): groups of NS slices over the
   threads, each group's successor prefetched while it computes. dispatch(flag, rows, slices, xt, K, w, s0, y, N)
   runs one group. */
typedef void (*side_dispatch)(int, int, int, const float *, int64_t, const tile_weight *, int64_t, float *, int64_t);
static int side_by_side(side_dispatch dispatch, int flag, float *y, const float *x, int64_t M, int64_t N, int64_t K,
                        const tile_weight *w, int num_threads)
{
    const float *xt = transposed_x(x, M, K);      /* x transposed: [K][M] */
    if (!xt)
        return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < (N / VL + NS - 1) / NS; g++) {
        int64_t s0 = g * NS, ns = N / VL - s0 < NS ? N / VL - s0 : NS;
        if (s0 + ns < N / VL)
            tile_prefetch(w, s0 + ns, K, 0, K);
        dispatch(flag, (int)M, (int)ns, xt, K, w, s0, y, N);
    }
    return 0;
}

/* fused_q4_1_side_dispatch as side_by_side calls it (no flag) */
static void q4_1_side(int flag, int mr, int ns, const float *xt, int64_t K, const tile_weight *w, int64_t s0,
                      float *y, int64_t N)
{
    (void)flag;
    fused_q4_1_side_dispatch(mr, ns, xt, K, w->qs, w->d, w->m, s0, y, N);
}

int steploop_packed_linear(float *y, const float *x, const void *qs, const float *d, const float *m, int64_t M,
                           int64_t N, int64_t K, int kind, int num_threads)
{
    if (M < 0 || N <= 0 || K <= 0 || N % G || K % QK || (kind != KIND_Q4_1 && kind != KIND_Q8_0))
        return -1;
    if (M == 0)
        return 0;
    if (steploop_int8_activations_on)      /* opt-in, not exact: int8_activations.c */
        return kind == KIND_Q4_1 ? steploop_int8_linear_q4_1(y, x, qs, d, m, M, N, K, num_threads)
                                 : steploop_int8_linear_q8_0(y, x, qs, d, M, N, K, num_threads);
    tile_weight w = {kind == KIND_Q4_1 ? TILE_Q4_1 : TILE_Q8_0, qs, d, m, 0, NULL, NULL, NULL, NULL};
    if (M <= REGISTER_MAX_M && kind == KIND_Q4_1)
        return side_by_side(q4_1_side, 0, y, x, M, N, K, &w, num_threads);
    if (M <= REGISTER_MAX_M) {
        const float *xt = transposed_x(x, M, K);      /* x transposed: [K][M] */
        if (!xt)
            return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t sl = 0; sl < N / VL; sl++) {
            /* the next slice's bytes (this thread's, in a static schedule) arrive while this one computes */
            if (sl + 1 < N / VL)
                prefetch_chunk(kind, qs, d, m, sl + 1, K, 0, K);
            switch (M) {
            case 1: fused_q8_0(1, xt, K, qs, d, sl, y, N); break;
            case 2: fused_q8_0(2, xt, K, qs, d, sl, y, N); break;
#if REGISTER_MAX_M == 4
            case 3: fused_q8_0(3, xt, K, qs, d, sl, y, N); break;
            case 4: fused_q8_0(4, xt, K, qs, d, sl, y, N); break;
#endif
            }
        }
        return 0;
    }
    return tile_matmul(y, x, M, N, K, &w, num_threads);
}

/* ---- int8 blocks of 16 or 32 with an optional per-block m: the GGUF types the Q4_1 / Q8_0 forms cannot hold ----

   GGUF files read directly (gguf_weights.py) keep Q5_1 and Q5_K (w = d * q + m, q in 0..31; Q5_K's d and m are
   its super-block scale times the sub-block's 6-bit scale and min, products exact in fp32) in blocks of 32, and
   Q6_K (w = d * q, q in -32..31, one int8 scale per 16) in blocks of 16. The layout is Q8_0's with the block
   size BS and, when there is one, m beside d:
     qs int8 [N/16][K][16];  d (and m) float [N/16][K/BS][16]
   d * q is exact (d has at most 19 significant bits, |q| <= 32), so each weight rounds once, as gguf-py's
   dequantize does. Each output is still one fma chain over k in order. */

static inline int64_t scale_bs_at(int64_t s, int64_t K, int64_t b, int bs)
{
    return (s * VL / G * (K / bs) + b) * G + s * VL % G;
}

static inline __attribute__((always_inline)) void dequant_q8b(int bs, int has_m, const int8_t *qs, const float *d,
                                                              const float *m, int64_t s, int64_t K, int64_t k0,
                                                              int64_t kc, float *tile, int64_t col)
{
    for (int64_t b = k0 / bs; b < (k0 + kc) / bs; b++) {
        vf db = loadv(d + scale_bs_at(s, K, b, bs)), mb = has_m ? loadv(m + scale_bs_at(s, K, b, bs)) : (vf){0};
        for (int64_t j = 0; j < bs; j++) {
            int64_t k = b * bs + j;
            vf w = __builtin_convertvector(widen_s8(qs + q8_at(s, K, k)), vf) * db;
            storev(tile + (k - k0) * NR + col, has_m ? w + mb : w);
        }
    }
}

static void dequant_q8b_dispatch(int bs, const int8_t *qs, const float *d, const float *m, int64_t s, int64_t K,
                                 int64_t k0, int64_t kc, float *tile, int64_t col)
{
    if (bs == 16 && !m)
        dequant_q8b(16, 0, qs, d, m, s, K, k0, kc, tile, col);
    else if (bs == 16)
        dequant_q8b(16, 1, qs, d, m, s, K, k0, kc, tile, col);
    else if (!m)
        dequant_q8b(32, 0, qs, d, m, s, K, k0, kc, tile, col);
    else
        dequant_q8b(32, 1, qs, d, m, s, K, k0, kc, tile, col);
}

/* Up to REGISTER_MAX_M rows: slice s's weights dequantized in registers and used at once (as fused_q8_0) */
static inline __attribute__((always_inline)) void fused_q8b(int mr, int bs, int has_m, const float *restrict xt,
                                                            int64_t K, const int8_t *restrict qs,
                                                            const float *restrict d, const float *restrict m,
                                                            int64_t s, float *restrict y, int64_t N)
{
    vf acc[REGISTER_MAX_M];
    for (int r = 0; r < mr; r++)
        acc[r] = (vf){0};
    for (int64_t b = 0; b < K / bs; b++) {
        vf db = loadv(d + scale_bs_at(s, K, b, bs)), mb = has_m ? loadv(m + scale_bs_at(s, K, b, bs)) : (vf){0};
        for (int64_t i = 0; i < bs; i++) {
            int64_t k = b * bs + i;
            vf w = __builtin_convertvector(widen_s8(qs + q8_at(s, K, k)), vf) * db;
            if (has_m)
                w += mb;
            for (int r = 0; r < mr; r++)
                acc[r] += xt[k * mr + r] * w;
        }
    }
    for (int r = 0; r < mr; r++)
        storev(y + r * N + s * VL, acc[r]);
}

static void fused_q8b_dispatch(int mr, int bs, const float *xt, int64_t K, const int8_t *qs, const float *d,
                               const float *m, int64_t s, float *y, int64_t N)
{
#define Q8B_CASE(R, B, HM)                                          \
    if (mr == R && bs == B && !!m == HM) {                          \
        fused_q8b(R, B, HM, xt, K, qs, d, m, s, y, N);              \
        return;                                                     \
    }
    Q8B_CASE(1, 16, 0) Q8B_CASE(1, 16, 1) Q8B_CASE(1, 32, 0) Q8B_CASE(1, 32, 1)
    Q8B_CASE(2, 16, 0) Q8B_CASE(2, 16, 1) Q8B_CASE(2, 32, 0) Q8B_CASE(2, 32, 1)
#if REGISTER_MAX_M == 4
    Q8B_CASE(3, 16, 0) Q8B_CASE(3, 16, 1) Q8B_CASE(3, 32, 0) Q8B_CASE(3, 32, 1)
    Q8B_CASE(4, 16, 0) Q8B_CASE(4, 16, 1) Q8B_CASE(4, 32, 0) Q8B_CASE(4, 32, 1)
#endif
#undef Q8B_CASE
}

static void prefetch_q8b(const int8_t *qs, const float *d, const float *m, int bs, int64_t s, int64_t K, int64_t k0,
                         int64_t kc)
{
    int64_t b0 = k0 / bs, nb = kc / bs;
    prefetch_range(d + scale_bs_at(s, K, b0, bs), ((nb - 1) * G + VL) * 4);
    if (m)
        prefetch_range(m + scale_bs_at(s, K, b0, bs), ((nb - 1) * G + VL) * 4);
    prefetch_range(qs + q8_at(s, K, k0), (kc - 1) * G + VL);
}

/* x [M, K], y [M, N] fp32 row-major; N % 16 == 0, K % 32 == 0, bs 16 or 32; m NULL when the blocks have none.
   Returns 0, or -1 on bad sizes or no memory. The same two paths as steploop_packed_linear. */
int steploop_packed_linear_q8b(float *y, const float *x, const int8_t *qs, const float *d, const float *m,
                               int64_t M, int64_t N, int64_t K, int bs, int num_threads)
{
    if (M < 0 || N <= 0 || K <= 0 || N % G || K % QK || (bs != 16 && bs != 32))
        return -1;
    if (M == 0)
        return 0;
    if (M <= REGISTER_MAX_M) {
        const float *xt = transposed_x(x, M, K);      /* x transposed: [K][M] */
        if (!xt)
            return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t sl = 0; sl < N / VL; sl++) {
            if (sl + 1 < N / VL)
                prefetch_q8b(qs, d, m, bs, sl + 1, K, 0, K);
            fused_q8b_dispatch((int)M, bs, xt, K, qs, d, m, sl, y, N);
        }
        return 0;
    }
    tile_weight w = {TILE_Q8B, qs, d, m, bs, NULL, NULL, NULL, NULL};
    return tile_matmul(y, x, M, N, K, &w, num_threads);
}

/* ---- GGUF Q4_K at its file width: 4-bit q, 6-bit scales and mins per 32, fp32 d and dmin per 256 ----

   Layout, per group of 16 output rows (4.75 bits a weight; the file's Q4_K: 4.5):
     qs uint8 [N/16][K/2][16] as the Q4_1 form (byte = q(k even) | q(k odd) << 4)
     sc, mn uint8 [N/16][K/32][16] each (sc then mn in one buffer)
     d, dmin float [N/16][K/256][16] each (d then dmin in one buffer)
   Sub-block b's scale and offset are computed as gguf-py does, d * sc and dmin * mn (exact in fp32: 11 x 6
   significant bits), and its weights are q * (d sc) - dmin mn, the product exact and one rounding: the file's own
   dequantized values, as the Q4_1 form holds them precomputed. */

#define QK_K 256

static inline int64_t superblock_at(int64_t s, int64_t K, int64_t sb)
{
    return (s * VL / G * (K / QK_K) + sb) * G + s * VL % G;
}

/* sub-block b of slice s: its fp32 scale and (negated) offset vectors */
static inline void q4k_dm(const uint8_t *sc, const uint8_t *mn, const float *d, const float *dmin, int64_t s,
                          int64_t K, int64_t b, vf *db, vf *mb)
{
    int64_t sb = superblock_at(s, K, b / (QK_K / QK));
    *db = loadv(d + sb) * __builtin_convertvector(widen_u8(sc + scale_at(s, K, b)), vf);
    *mb = -(loadv(dmin + sb) * __builtin_convertvector(widen_u8(mn + scale_at(s, K, b)), vf));
}

static void dequant_q4k(const uint8_t *qs, const uint8_t *sc, const uint8_t *mn, const float *d, const float *dmin,
                        int64_t s, int64_t K, int64_t k0, int64_t kc, float *tile, int64_t col)
{
    for (int64_t b = k0 / QK; b < (k0 + kc) / QK; b++) {
        vf db, mb;
        q4k_dm(sc, mn, d, dmin, s, K, b, &db, &mb);
        for (int64_t p = 0; p < QK / 2; p++) {
            int64_t k = b * QK + 2 * p;
            vi iv = widen_u8(qs + q4_at(s, K, k));
            storev(tile + (k - k0) * NR + col, __builtin_convertvector(iv & 15, vf) * db + mb);
            storev(tile + (k - k0 + 1) * NR + col, __builtin_convertvector(iv >> 4, vf) * db + mb);
        }
    }
}

/* Up to REGISTER_MAX_M rows: NS slices side by side, as fused_q4_1_side */
static inline __attribute__((always_inline)) void fused_q4k_side(int mr, int ns, const float *restrict xt, int64_t K,
                                                                 const uint8_t *restrict qs, const uint8_t *sc,
                                                                 const uint8_t *mn, const float *d,
                                                                 const float *dmin, int64_t s0, float *restrict y,
                                                                 int64_t N)
{
    vf acc[NS][REGISTER_MAX_M];
    for (int i = 0; i < ns; i++)
        for (int r = 0; r < mr; r++)
            acc[i][r] = (vf){0};
    for (int64_t b = 0; b < K / QK; b++) {
        vf db[NS], mb[NS];
        for (int i = 0; i < ns; i++)
            q4k_dm(sc, mn, d, dmin, s0 + i, K, b, &db[i], &mb[i]);
        for (int64_t p = 0; p < QK / 2; p++) {
            int64_t k = b * QK + 2 * p;
            for (int i = 0; i < ns; i++) {
                vi iv = widen_u8(qs + q4_at(s0 + i, K, k));
                vf w0 = __builtin_convertvector(iv & 15, vf) * db[i] + mb[i];
                vf w1 = __builtin_convertvector(iv >> 4, vf) * db[i] + mb[i];
                for (int r = 0; r < mr; r++)
                    acc[i][r] += xt[k * mr + r] * w0;
                for (int r = 0; r < mr; r++)
                    acc[i][r] += xt[(k + 1) * mr + r] * w1;
            }
        }
    }
    for (int i = 0; i < ns; i++)
        for (int r = 0; r < mr; r++)
            storev(y + r * N + (s0 + i) * VL, acc[i][r]);
}

static void fused_q4k_side_dispatch(int mr, int ns, const float *xt, int64_t K, const uint8_t *qs, const uint8_t *sc,
                                    const uint8_t *mn, const float *d, const float *dmin, int64_t s0, float *y,
                                    int64_t N)
{
#define Q4K_CASE(F, R, S)                                                        \
    if (mr == R && ns == S) {                                                 \
        fused_q4k_side(R, S, xt, K, qs, sc, mn, d, dmin, s0, y, N);           \
        return;                                                               \
    }
    ROWS_SLICES(Q4K_CASE, 0)
#undef Q4K_CASE
}

static void prefetch_q4k(const uint8_t *qs, const uint8_t *sc, const uint8_t *mn, int64_t s, int64_t K, int64_t k0,
                         int64_t kc)
{
    int64_t b0 = k0 / QK, nb = kc / QK;
    prefetch_range(sc + scale_at(s, K, b0), (nb - 1) * G + VL);
    prefetch_range(mn + scale_at(s, K, b0), (nb - 1) * G + VL);
    prefetch_range(qs + q4_at(s, K, k0), (kc / 2 - 1) * G + VL);
}

/* x [M, K], y [M, N] fp32 row-major; N % 16 == 0, K % 256 == 0. scales: sc then mn (uint8, N * K / 32 each);
   dd: d then dmin (fp32, N * K / 256 each). Returns 0, or -1 on bad sizes or no memory. */
/* fused_q4k_side_dispatch as side_by_side calls it (no flag) */
static void q4k_side(int flag, int mr, int ns, const float *xt, int64_t K, const tile_weight *w, int64_t s0, float *y,
                     int64_t N)
{
    (void)flag;
    fused_q4k_side_dispatch(mr, ns, xt, K, w->qs, w->sc, w->mn, w->d, w->dmin, s0, y, N);
}

int steploop_packed_linear_q4k(float *y, const float *x, const uint8_t *qs, const float *dd, const uint8_t *scales,
                               int64_t M, int64_t N, int64_t K, int num_threads)
{
    if (M < 0 || N <= 0 || K <= 0 || N % G || K % QK_K)
        return -1;
    if (steploop_int8_activations_on)      /* opt-in, not exact: int8_activations.c */
        return steploop_int8_linear_q4k(y, x, qs, dd, scales, M, N, K, num_threads);
    if (M == 0)
        return 0;
    const uint8_t *sc = scales, *mn = scales + N * (K / QK);
    const float *d = dd, *dmin = dd + N * (K / QK_K);
    tile_weight w = {TILE_Q4K, qs, d, NULL, 0, sc, mn, dmin, NULL};
    if (M <= REGISTER_MAX_M)
        return side_by_side(q4k_side, 0, y, x, M, N, K, &w, num_threads);
    return tile_matmul(y, x, M, N, K, &w, num_threads);
}

/* ---- GGUF Q5_K and Q6_K at their file width: the nibble plane of the Q4_1 form plus a plane of high bits ----

   Layout, per group of 16 output rows (N rows, K along the row):
     Q5_K (5.75 bits a weight; the file's: 5.5): qs uint8 = nibbles [N/16][K/2][16] as Q4_1's, then fifth bits
       [N/16][K/8][16] (bit j of a byte: weight k + j, k a multiple of 8); sc, mn and d, dmin as the Q4_K form's.
       w = q * (d sc) - dmin mn, q = nibble | fifth bit << 4 in 0..31: gguf-py's d * q - dm (the product exact:
       11 x 6 x 5 significant bits), one rounding.
     Q6_K (6.625 bits; the file's: 6.5625): qs uint8 = nibbles [N/16][K/2][16], then two high bits
       [N/16][K/4][16] (bits 2j, 2j + 1 of a byte: weight k + j, k a multiple of 4); sc int8 [N/16][K/16][16];
       d float [N/16][K/256][16]. w = (q - 32) * (d sc), q = nibble | high bits << 4 in 0..63: gguf-py's
       (d * scales) * q, exact (11 + 7 + 6 = 24 significant bits at most), so no rounding at all.
   Each output is one fma chain over k in order, as in every form above. */

static inline int64_t sub16_at(int64_t s, int64_t K, int64_t b) { return (s * VL / G * (K / 16) + b) * G + s * VL % G; }
static inline int64_t q1_at(int64_t s, int64_t K, int64_t k) { return (s * VL / G * (K / 8) + k / 8) * G + s * VL % G; }
static inline int64_t q2_at(int64_t s, int64_t K, int64_t k) { return (s * VL / G * (K / 4) + k / 4) * G + s * VL % G; }

/* Q5_K: slice s's weights k .. k + 7 (k a multiple of 8) with sub-block scale db and offset mb */
static inline __attribute__((always_inline)) void q5k_w8(const uint8_t *lo, const uint8_t *hi, int64_t s, int64_t K,
                                                         int64_t k, vf db, vf mb, vf w[8])
{
    vi h = widen_u8(hi + q1_at(s, K, k));
    for (int p = 0; p < 4; p++) {
        vi iv = widen_u8(lo + q4_at(s, K, k + 2 * p));
        w[2 * p] = __builtin_convertvector((iv & 15) | (((h >> (2 * p)) & 1) << 4), vf) * db + mb;
        w[2 * p + 1] = __builtin_convertvector((iv >> 4) | (((h >> (2 * p + 1)) & 1) << 4), vf) * db + mb;
    }
}

/* Q6_K: slice s's weights k .. k + 3 (k a multiple of 4) with sub-block scale db and mb = -32 db: q db + mb is
   (q - 32) db exactly (q db, 32 db and their difference all fit fp32's 24 bits), one fma instead of a subtract
   and a multiply */
static inline __attribute__((always_inline)) void q6k_w4(const uint8_t *lo, const uint8_t *hi, int64_t s, int64_t K,
                                                         int64_t k, vf db, vf mb, vf w[4])
{
    vi a = widen_u8(lo + q4_at(s, K, k)), b = widen_u8(lo + q4_at(s, K, k + 2)), h = widen_u8(hi + q2_at(s, K, k));
    w[0] = __builtin_convertvector((a & 15) | ((h << 4) & 48), vf) * db + mb;
    w[1] = __builtin_convertvector((a >> 4) | ((h << 2) & 48), vf) * db + mb;
    w[2] = __builtin_convertvector((b & 15) | (h & 48), vf) * db + mb;
    w[3] = __builtin_convertvector((b >> 4) | ((h >> 2) & 48), vf) * db + mb;
}

/* Q6_K sub-block b (16 weights) of slice s: d * sc */
static inline vf q6k_db(const tile_weight *w, int64_t s, int64_t K, int64_t b)
{
    return loadv(w->d + superblock_at(s, K, b / (QK_K / 16))) *
           __builtin_convertvector(widen_s8((const int8_t *)w->sc + sub16_at(s, K, b)), vf);
}

static void dequant_q5k(const tile_weight *w, int64_t s, int64_t K, int64_t k0, int64_t kc, float *tile, int64_t col)
{
    for (int64_t b = k0 / QK; b < (k0 + kc) / QK; b++) {
        vf db, mb, wv[8];
        q4k_dm(w->sc, w->mn, w->d, w->dmin, s, K, b, &db, &mb);
        for (int64_t k = b * QK; k < b * QK + QK; k += 8) {
            q5k_w8(w->qs, w->qh, s, K, k, db, mb, wv);
            for (int j = 0; j < 8; j++)
                storev(tile + (k + j - k0) * NR + col, wv[j]);
        }
    }
}

static void dequant_q6k(const tile_weight *w, int64_t s, int64_t K, int64_t k0, int64_t kc, float *tile, int64_t col)
{
    for (int64_t b = k0 / 16; b < (k0 + kc) / 16; b++) {
        vf db = q6k_db(w, s, K, b), mb = db * -32.0f, wv[4];
        for (int64_t k = b * 16; k < b * 16 + 16; k += 4) {
            q6k_w4(w->qs, w->qh, s, K, k, db, mb, wv);
            for (int j = 0; j < 4; j++)
                storev(tile + (k + j - k0) * NR + col, wv[j]);
        }
    }
}

static void prefetch_q5k(const tile_weight *w, int64_t s, int64_t K, int64_t k0, int64_t kc)
{
    prefetch_q4k(w->qs, w->sc, w->mn, s, K, k0, kc);
    prefetch_range(w->qh + q1_at(s, K, k0), (kc / 8 - 1) * G + VL);
}

static void prefetch_q6k(const tile_weight *w, int64_t s, int64_t K, int64_t k0, int64_t kc)
{
    prefetch_range(w->sc + sub16_at(s, K, k0 / 16), (kc / 16 - 1) * G + VL);
    prefetch_range(w->qs + q4_at(s, K, k0), (kc / 2 - 1) * G + VL);
    prefetch_range(w->qh + q2_at(s, K, k0), (kc / 4 - 1) * G + VL);
}

/* Up to REGISTER_MAX_M rows: NS slices side by side (as fused_q4k_side), each weight dequantized in registers and
   used at once. q6 picks the form: 1 Q6_K, 0 Q5_K. */
static inline __attribute__((always_inline)) void fused_k_side(int q6, int mr, int ns, const float *restrict xt,
                                                               int64_t K, const tile_weight *w, int64_t s0,
                                                               float *restrict y, int64_t N)
{
    enum { STEP = 8 };                       /* weights per inner step: one Q5_K fifth-bit byte, two Q6_K ones */
    vf acc[NS][REGISTER_MAX_M];
    for (int i = 0; i < ns; i++)
        for (int r = 0; r < mr; r++)
            acc[i][r] = (vf){0};
    const int64_t bs = q6 ? 16 : QK;
    for (int64_t b = 0; b < K / bs; b++) {
        vf db[NS], mb[NS];
        for (int i = 0; i < ns; i++) {
            if (q6) {
                db[i] = q6k_db(w, s0 + i, K, b);
                mb[i] = db[i] * -32.0f;
            } else
                q4k_dm(w->sc, w->mn, w->d, w->dmin, s0 + i, K, b, &db[i], &mb[i]);
        }
        for (int64_t k = b * bs; k < b * bs + bs; k += STEP) {
            for (int i = 0; i < ns; i++) {
                vf wv[STEP];
                if (q6) {
                    q6k_w4(w->qs, w->qh, s0 + i, K, k, db[i], mb[i], wv);
                    q6k_w4(w->qs, w->qh, s0 + i, K, k + 4, db[i], mb[i], wv + 4);
                } else {
                    q5k_w8(w->qs, w->qh, s0 + i, K, k, db[i], mb[i], wv);
                }
                for (int j = 0; j < STEP; j++)
                    for (int r = 0; r < mr; r++)
                        acc[i][r] += xt[(k + j) * mr + r] * wv[j];
            }
        }
    }
    for (int i = 0; i < ns; i++)
        for (int r = 0; r < mr; r++)
            storev(y + r * N + (s0 + i) * VL, acc[i][r]);
}

static void fused_k_side_dispatch(int q6, int mr, int ns, const float *xt, int64_t K, const tile_weight *w,
                                  int64_t s0, float *y, int64_t N)
{
#define K_CASE(Q, R, S)                                               \
    if (q6 == Q && mr == R && ns == S) {                              \
        fused_k_side(Q, R, S, xt, K, w, s0, y, N);                    \
        return;                                                       \
    }
    FLAG_ROWS_SLICES(K_CASE)
#undef K_CASE
}

/* x [M, K], y [M, N] fp32 row-major; N % 16 == 0, K % 256 == 0. q6: 1 for the Q6_K form (qs: nibbles then high
   bits; scales: int8 sc per 16; dd: d per 256), 0 for Q5_K (qs: nibbles then fifth bits; scales: sc then mn per 32;
   dd: d then dmin per 256). Returns 0, or -1 on bad sizes or no memory. */
int steploop_packed_linear_kquant(float *y, const float *x, const uint8_t *qs, const float *dd, const uint8_t *scales,
                                  int64_t M, int64_t N, int64_t K, int q6, int num_threads)
{
    if (M < 0 || N <= 0 || K <= 0 || N % G || K % QK_K)
        return -1;
    if (q6 && steploop_int8_activations_on)
        return steploop_int8_linear_q6k(y, x, qs, dd, scales, M, N, K, num_threads);
    if (M == 0)
        return 0;
    tile_weight w = {q6 ? TILE_Q6K : TILE_Q5K, qs, dd, NULL, 0, scales, q6 ? NULL : scales + N * (K / QK),
                     q6 ? NULL : dd + N * (K / QK_K), qs + N * K / 2};
    if (M <= REGISTER_MAX_M)
        return side_by_side(fused_k_side_dispatch, !!q6, y, x, M, N, K, &w, num_threads);
    return tile_matmul(y, x, M, N, K, &w, num_threads);
}

/* ---- 16-bit weights (a bf16 or fp16 checkpoint kept at its width): exact widening, fp32 arithmetic ----

   Layout, as the Q8_0 form's with 2-byte values and no scales (its q8_at offsets): w uint16 [N/16][K][16] (the
   checkpoint's bits).
   bf16 -> fp32 is the 16 bits moved to the top; fp16 -> fp32 is vcvtph2ps (F16C, in the AVX2 and AVX-512 builds) or
   the same conversion in integers (the generic build); both are exact, subnormals, infinities and NaNs included.
   So each weight is the checkpoint's value as transformers upcasts it, and each output one fma chain over k in
   order, as in every form above. K is any length (no blocks). */

#if VL == 16
static inline vi widen_u16(const uint16_t *p)
{
    return (vi)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
}
static inline vf f16_to_f32(const uint16_t *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif VL == 8
static inline vi widen_u16(const uint16_t *p) { return (vi)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vf f16_to_f32(const uint16_t *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline vi widen_u16(const uint16_t *p) { vi v; for (int i = 0; i < VL; i++) v[i] = p[i]; return v; }
/* IEEE half -> single in integers: normal numbers rebias the exponent (15 -> 127); subnormals are mant * 2^-24,
   exact in fp32; exponent 31 keeps infinity / NaN (payload shifted up, as vcvtph2ps does) */
static inline vf f16_to_f32(const uint16_t *p)
{
    vi h = widen_u16(p);
    vi sign = (h & 0x8000) << 16, exp = (h >> 10) & 31, mant = h & 0x3ff;
    vi normal = sign | ((exp + 112) << 23) | (mant << 13);
    vi special = sign | 0x7f800000 | (mant << 13);
    vf sub = __builtin_convertvector(mant, vf) * 5.9604644775390625e-8f;        /* 2^-24 */
    vf subnormal = (vf)((vi)sub | sign);
    vf out = select_lanes(exp == 31, (vf)special, (vf)normal);
    return select_lanes(exp == 0, subnormal, out);
}
#endif

static inline vf widen16(int f16, const uint16_t *p) { return f16 ? f16_to_f32(p) : (vf)(widen_u16(p) << 16); }

static void dequant_w16(int f16, const uint16_t *w, int64_t s, int64_t K, int64_t k0, int64_t kc, float *tile,
                        int64_t col)
{
    for (int64_t k = k0; k < k0 + kc; k++)
        storev(tile + (k - k0) * NR + col, widen16(f16, w + q8_at(s, K, k)));
}

static void prefetch_w16(const uint16_t *w, int64_t s, int64_t K, int64_t k0, int64_t kc)
{
    prefetch_range(w + q8_at(s, K, k0), ((kc - 1) * G + VL) * 2);
}

/* Up to REGISTER_MAX_M rows: NS slices side by side, each weight widened in registers and used at once (as Q4_1's) */
static inline __attribute__((always_inline)) void fused_w16(int f16, int mr, int ns, const float *restrict xt,
                                                            int64_t K, const uint16_t *restrict w, int64_t s0,
                                                            float *restrict y, int64_t N)
{
    vf acc[NS][REGISTER_MAX_M];
    for (int i = 0; i < ns; i++)
        for (int r = 0; r < mr; r++)
            acc[i][r] = (vf){0};
    for (int64_t k = 0; k < K; k++)
        for (int i = 0; i < ns; i++) {
            vf wv = widen16(f16, w + q8_at(s0 + i, K, k));
            for (int r = 0; r < mr; r++)
                acc[i][r] += xt[k * mr + r] * wv;
        }
    for (int i = 0; i < ns; i++)
        for (int r = 0; r < mr; r++)
            storev(y + r * N + (s0 + i) * VL, acc[i][r]);
}

static void fused_w16_dispatch(int f16, int mr, int ns, const float *xt, int64_t K, const tile_weight *w,
                               int64_t s0, float *y, int64_t N)
{
#define W16_CASE(F, R, S)                                        \
    if (f16 == F && mr == R && ns == S) {                        \
        fused_w16(F, R, S, xt, K, w->qs, s0, y, N);              \
        return;                                                  \
    }
    FLAG_ROWS_SLICES(W16_CASE)
#undef W16_CASE
}

/* x [M, K], y [M, N] fp32 row-major; w the layout above; f16 1: IEEE half, 0: bfloat16; N % 16 == 0. Returns 0,
   or -1 on bad sizes or no memory. The same two paths as steploop_packed_linear. */
int steploop_packed_linear_w16(float *y, const float *x, const uint16_t *w, int64_t M, int64_t N, int64_t K, int f16,
                               int num_threads)
{
    if (M < 0 || N <= 0 || K <= 0 || N % G)
        return -1;
    if (M == 0)
        return 0;
    tile_weight tw = {f16 ? TILE_F16 : TILE_BF16, w, NULL, NULL, 0, NULL, NULL, NULL, NULL};
    if (M <= REGISTER_MAX_M)
        return side_by_side(fused_w16_dispatch, !!f16, y, x, M, N, K, &tw, num_threads);
    return tile_matmul(y, x, M, N, K, &tw, num_threads);
}
