/* Paged decode attention on the CPU, fused: reads K/V straight from the paged cache (no gather copy), fp32.

   One OpenMP work item per query token (or per (token, KV head) when there are too few tokens to share out): its
   query heads walk the request's block table in order, scores by dot products over head_dim, online softmax
   (running max and sum, one rescale per tile of <= 32 keys inside one block), V accumulated in L1; out[t, h, :]
   written at the end. A whole token's item reads each key's K/V row whole, so the hardware prefetcher follows it
   through a block; (token, KV head) items read a third of each row at a stride (from DRAM, benchmarks/
   paged_attention.py: ~25% slower, ~7% with the software prefetch below).
   Query i of a request with seq_len L and query_len n attends keys j <= L - n + i (causal inside a short chunk).
   Each work item reduces its keys in a fixed order, so a token's result does not depend on the rest of the batch.

   When head_dim is a multiple of the vector width VL (vector_width.h), attend_lanes scores VL keys at a time: each
   key's q.k is VL partial sums over head_dim (one vector fma per VL dims), and the VL keys' partial vectors are
   added across lanes together by a shuffle tree (log2(VL) levels, ~3 operations a key) into one vector of VL
   scores; the softmax then runs on those lanes. Scoring key by key, each dot product ended in its own
   horizontal sum and the kernel ran at ~26 GFLOP/s on 2 AVX-512 cores (64 requests x 96 keys, 9 heads over 3).
   Other head sizes take attend, whose sums over head_dim and over a tile are plain loops that gcc vectorizes
   because build.py compiles with -fassociative-math (+ -fno-signed-zeros -fno-trapping-math, which it requires).
   Either way the order of every sum is fixed at compile time, so results stay deterministic.

   Layouts (all contiguous): q, out [T, H, D]; kv_cache [2, num_blocks, block_size, Hk, D] (0 = K, 1 = V);
   block_tables [R, max_blocks] int32; query_start_loc [R + 1] int32; seq_lens [R] int32.
   Returns 0, or -1 when an argument is out of range (e.g. a block id past num_blocks, query_start_loc past q's
   num_q_tokens rows); the plan is checked before any K/V is read, and out is then left untouched. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector_width.h"

#define MAX_H 256     /* query heads per work item (the kernel takes at most this many per KV head) */
#define MAX_D 256     /* head_dim */
#define MAX_HD 8192   /* query heads x head_dim per work item: the stack holds its scaled queries and accumulators */
#define TILE 32       /* keys scored per softmax rescale */

static inline vf loadv(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return (vf){0} + x; }
/* exp(x) for x <= 0 (and -inf) on VL lanes, ~2 ulp (glibc's expf is a scalar call without -ffast-math); exp(-87)
   ~ 1.6e-38 stands for anything below, 0 for our sums. n = ceil(y - 1/2) = round(y) for y = x / ln 2 <= 0, by
   truncation toward zero (the 1.5 * 2^23 rounding trick would be folded away under -fassociative-math). */
static inline vf exp_nonpos_lanes(vf x)
{
    x = select_lanes(x > splat(-87.0f), x, splat(-87.0f));
    return exp_reduced(x, __builtin_convertvector(__builtin_convertvector(x * 1.44269504f - 0.5f, vi), vf));
}

/* Blocks ahead of the one being scored whose K and V rows (the work item's heads) are prefetched. A work item
   walks scattered blocks and computes little per key, so without it each block's first loads waited on DRAM
   (benchmarks/paged_attention.py, 64 requests x 128 keys from DRAM: 0.87 vs 0.68 ms a layer on 2 AVX-512 cores;
   2 blocks ahead measured the same as 1). */
#define PREFETCH_BLOCKS 1

static inline void prefetch_block(const float *k_cache, const float *v_cache, const int32_t *table, int64_t b,
                                  int64_t num_keys, int64_t span, int64_t block_size, int64_t row)
{
    if (b * block_size >= num_keys)
        return;
    int64_t keys = num_keys - b * block_size < block_size ? num_keys - b * block_size : block_size;
    int64_t base = (int64_t)table[b] * block_size * row;
    for (int64_t j = 0; j < keys; j++)
        for (int64_t d = 0; d < span; d += 16) {     /* one 64-byte line per 16 floats */
            __builtin_prefetch(k_cache + base + j * row + d, 0, 1);
            __builtin_prefetch(v_cache + base + j * row + d, 0, 1);
        }
}

/* A query group's state: its G queries scaled, V accumulators at zero, running max -inf and sum 0; at the end
   each head's accumulated V divided by its sum. */
static inline __attribute__((always_inline)) void group_start(const float *restrict q, float scale, int64_t G,
                                                              int64_t D, float *restrict qs, float *restrict acc,
                                                              float *restrict m, float *restrict l)
{
    for (int64_t g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            qs[g * D + d] = q[g * D + d] * scale;
            acc[g * D + d] = 0.0f;
        }
    }
}

static inline __attribute__((always_inline)) void group_finish(float *restrict out, const float *restrict acc,
                                                               const float *restrict l, int64_t G, int64_t D)
{
    for (int64_t g = 0; g < G; g++) {
        float inv = 1.0f / l[g];
        for (int64_t d = 0; d < D; d++)
            out[g * D + d] = acc[g * D + d] * inv;
    }
}

static inline __attribute__((always_inline)) void attend(
    float *restrict out, const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
    const int32_t *restrict table, int64_t num_keys, int64_t NH, int64_t G, int64_t D, int64_t block_size,
    int64_t row, float scale)
{
    float qs[MAX_HD] __attribute__((aligned(64)));
    float acc[MAX_HD] __attribute__((aligned(64)));
    float s[TILE], m[MAX_H], l[MAX_H];
    group_start(q, scale, NH, D, qs, acc, m, l);
    for (int64_t b = 0; b < PREFETCH_BLOCKS; b++)
        prefetch_block(k_cache, v_cache, table, b, num_keys, NH / G * D, block_size, row);
    for (int64_t first = 0, n; first < num_keys; first += n) {   /* a tile never crosses a block boundary */
        int64_t off = first % block_size;
        if (off == 0)
            prefetch_block(k_cache, v_cache, table, first / block_size + PREFETCH_BLOCKS, num_keys, NH / G * D,
                           block_size, row);
        n = block_size - off;
        n = n < TILE ? n : TILE;
        n = n < num_keys - first ? n : num_keys - first;
        int64_t base = ((int64_t)table[first / block_size] * block_size + off) * row;
        for (int64_t g = 0; g < NH; g++) {
            const float *kt = k_cache + base + g / G * D, *vt = v_cache + base + g / G * D;
            const float *qg = qs + g * D;
            float *sg = s;
            for (int64_t j = 0; j < n; j++) {
                float dot = 0.0f;
                for (int64_t d = 0; d < D; d++)
                    dot += qg[d] * kt[j * row + d];
                sg[j] = dot;
            }
            float mx = m[g], sum = 0.0f;
            #pragma omp simd reduction(max:mx)
            for (int64_t j = 0; j < n; j++)
                mx = sg[j] > mx ? sg[j] : mx;
            for (int64_t j = 0; j < n; j += VL)     /* whole vectors: sg has TILE floats, TILE % VL == 0 */
                storev(sg + j, exp_nonpos_lanes(loadv(sg + j) - mx));
            for (int64_t j = 0; j < n; j++)
                sum += sg[j];
            float alpha = exp_nonpos_lanes(splat(m[g] - mx))[0];
            l[g] = l[g] * alpha + sum;
            m[g] = mx;
            float *ag = acc + g * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++)
                ag[d] *= alpha;
            for (int64_t j = 0; j < n; j++) {
                float p = sg[j];
                #pragma omp simd
                for (int64_t d = 0; d < D; d++)
                    ag[d] += p * vt[j * row + d];
            }
        }
    }
    group_finish(out, acc, l, NH, D);
}

/* One level of the shuffle tree: lanes in chunks of 2h, a's and b's pairs of h-lane halves added (see lane_sums). */
#if VL == 16
#define LEVEL(h, a, b)                                                                                           \
    ((h) == 1 ? __builtin_shuffle(a, b, (vi){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30})         \
                    + __builtin_shuffle(a, b, (vi){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31})   \
     : (h) == 2 ? __builtin_shuffle(a, b, (vi){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29})        \
                    + __builtin_shuffle(a, b, (vi){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31})  \
     : (h) == 4 ? __builtin_shuffle(a, b, (vi){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27})        \
                    + __builtin_shuffle(a, b, (vi){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31})  \
                : __builtin_shuffle(a, b, (vi){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23})          \
                    + __builtin_shuffle(a, b, (vi){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}))
#elif VL == 8
#define LEVEL(h, a, b)                                                                                           \
    ((h) == 1 ? __builtin_shuffle(a, b, (vi){0, 8, 2, 10, 4, 12, 6, 14})                                         \
                    + __builtin_shuffle(a, b, (vi){1, 9, 3, 11, 5, 13, 7, 15})                                   \
     : (h) == 2 ? __builtin_shuffle(a, b, (vi){0, 1, 8, 9, 4, 5, 12, 13})                                        \
                    + __builtin_shuffle(a, b, (vi){2, 3, 10, 11, 6, 7, 14, 15})                                  \
                : __builtin_shuffle(a, b, (vi){0, 1, 2, 3, 8, 9, 10, 11})                                        \
                    + __builtin_shuffle(a, b, (vi){4, 5, 6, 7, 12, 13, 14, 15}))
#else
#define LEVEL(h, a, b)                                                                                           \
    ((h) == 1 ? __builtin_shuffle(a, b, (vi){0, 4, 2, 6}) + __builtin_shuffle(a, b, (vi){1, 5, 3, 7})            \
              : __builtin_shuffle(a, b, (vi){0, 1, 4, 5}) + __builtin_shuffle(a, b, (vi){2, 3, 6, 7}))
#endif

/* p[0..VL) -> one vector whose lane j is the sum of p[j]'s lanes: level h pairs the vectors up, after it lane
   (i mod 2h) of a chunk of 2h holds a partial sum of vector i of the 2h it came from; p is overwritten. */
static inline __attribute__((always_inline)) vf lane_sums(vf *p)
{
#pragma GCC unroll 8
    for (int h = 1, n = VL; h < VL; h *= 2, n /= 2) {
#pragma GCC unroll 16
        for (int i = 0; i < n / 2; i++)
            p[i] = LEVEL(h, p[2 * i], p[2 * i + 1]);
    }
    return p[0];
}

/* the lanes' max and sum: halves folded pairwise (v[j] op= v[j + w] for w = VL/2 .. 1), the same fixed order
   whatever the lanes hold, as vector shuffles rather than a chain of scalar extracts */
#if VL == 16
#define FOLD(v, w)                                                                                             \
    ((w) == 8 ? __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15})         \
     : (w) == 4 ? __builtin_shuffle(v, (vi){4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7})                  \
     : (w) == 2 ? __builtin_shuffle(v, (vi){2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3})                  \
                : __builtin_shuffle(v, (vi){1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}))
#elif VL == 8
#define FOLD(v, w)                                                                                             \
    ((w) == 4 ? __builtin_shuffle(v, (vi){4, 5, 6, 7, 4, 5, 6, 7})                                            \
     : (w) == 2 ? __builtin_shuffle(v, (vi){2, 3, 2, 3, 2, 3, 2, 3})                                          \
                : __builtin_shuffle(v, (vi){1, 1, 1, 1, 1, 1, 1, 1}))
#else
#define FOLD(v, w) ((w) == 2 ? __builtin_shuffle(v, (vi){2, 3, 2, 3}) : __builtin_shuffle(v, (vi){1, 1, 1, 1}))
#endif

static inline __attribute__((always_inline)) float lanes_max(vf v)
{
#pragma GCC unroll 4
    for (int w = VL / 2; w >= 1; w /= 2) {
        vf o = FOLD(v, w);
        v = select_lanes(o > v, o, v);
    }
    return v[0];
}

static inline __attribute__((always_inline)) float lanes_sum(vf v)
{
#pragma GCC unroll 4
    for (int w = VL / 2; w >= 1; w /= 2)
        v += FOLD(v, w);
    return v[0];
}

/* One head's scores over n <= VL keys of one block (kt: their K rows for this head's KV head) and its online
   softmax update of m and l: returns the keys' weights p (0 past n) and writes the rescale of the head's V
   accumulator to *alpha. n is a constant VL for every group but a request's last, so the loops over keys unroll
   without bounds checks. */
static inline __attribute__((always_inline)) vf score_group(int64_t n, const float *restrict qg,
                                                            const float *restrict kt, float *restrict m,
                                                            float *restrict l, float *restrict alpha, int64_t C,
                                                            int64_t row, vi valid)
{
    vf part[VL];
    for (int64_t j = 0; j < VL; j++) {
        vf dot = (vf){0};
        if (j < n)
            for (int64_t c = 0; c < C; c++)
                dot += loadv(qg + c * VL) * loadv(kt + j * row + c * VL);
        part[j] = dot;
    }
    vf sc = lane_sums(part);
    if (n < VL)
        sc = select_lanes(valid, sc, splat(-INFINITY));
    float mx = lanes_max(sc);
    mx = mx > *m ? mx : *m;
    vf p = exp_nonpos_lanes(sc - mx);
    if (n < VL)
        p = select_lanes(valid, p, (vf){0});
    *alpha = exp_nonpos_lanes(splat(*m - mx))[0];
    *l = *l * *alpha + lanes_sum(p);
    *m = mx;
    return p;
}

/* ag = ag * alpha + sum_j p[j] * v[j] over the n keys, each element in key order */
static inline __attribute__((always_inline)) void accumulate_group(int64_t n, const float *restrict p, float alpha,
                                                                   const float *restrict vt, float *restrict ag,
                                                                   int64_t C, int64_t row)
{
    vf a[MAX_D / VL];
    for (int64_t c = 0; c < C; c++)
        a[c] = loadv(ag + c * VL) * alpha;
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = 0; c < C; c++)
            a[c] += p[j] * loadv(vt + j * row + c * VL);
    for (int64_t c = 0; c < C; c++)
        storev(ag + c * VL, a[c]);
}

/* attend for head_dim D a multiple of VL: keys scored VL at a time (see the top). */
static inline __attribute__((always_inline)) void attend_lanes(
    float *restrict out, const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
    const int32_t *restrict table, int64_t num_keys, int64_t NH, int64_t G, int64_t D, int64_t block_size,
    int64_t row, float scale)
{
    float qs[MAX_HD] __attribute__((aligned(64)));
    float acc[MAX_HD] __attribute__((aligned(64)));
    float m[MAX_H], l[MAX_H], alpha[MAX_H], p[MAX_H * VL] __attribute__((aligned(64)));
    const int64_t C = D / VL;
    group_start(q, scale, NH, D, qs, acc, m, l);
    vi lane;
    for (int j = 0; j < VL; j++)
        lane[j] = j;
    for (int64_t b = 0; b < PREFETCH_BLOCKS; b++)
        prefetch_block(k_cache, v_cache, table, b, num_keys, NH / G * D, block_size, row);
    for (int64_t first = 0, n; first < num_keys; first += n) {   /* a group never crosses a block boundary */
        int64_t off = first % block_size;
        if (off == 0)
            prefetch_block(k_cache, v_cache, table, first / block_size + PREFETCH_BLOCKS, num_keys, NH / G * D,
                           block_size, row);
        n = block_size - off;
        n = n < VL ? n : VL;
        n = n < num_keys - first ? n : num_keys - first;
        int64_t base = ((int64_t)table[first / block_size] * block_size + off) * row;
        vi valid = lane < (vi){0} + (int32_t)n;
        /* every head's softmax first, then every head's V: each phase's heads are independent, so the CPU
           overlaps them instead of waiting on one head's chain of max, exp and the fmas into its accumulator */
        for (int64_t g = 0; g < NH; g++)
            storev(p + g * VL, n == VL ? score_group(VL, qs + g * D, k_cache + base + g / G * D, m + g, l + g,
                                                     alpha + g, C, row, valid)
                                       : score_group(n, qs + g * D, k_cache + base + g / G * D, m + g, l + g,
                                                     alpha + g, C, row, valid));
        for (int64_t g = 0; g < NH; g++) {
            if (n == VL)
                accumulate_group(VL, p + g * VL, alpha[g], v_cache + base + g / G * D, acc + g * D, C, row);
            else
                accumulate_group(n, p + g * VL, alpha[g], v_cache + base + g / G * D, acc + g * D, C, row);
        }
    }
    group_finish(out, acc, l, NH, D);
}

int steploop_paged_attention(float *out, const float *q, const float *kv_cache, const int32_t *block_tables,
                             const int32_t *query_start_loc, const int32_t *seq_lens, int64_t num_q_tokens,
                             int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t num_blocks, int64_t block_size, int64_t max_blocks, float scale,
                             int num_threads)
{
    if (num_reqs < 0 || num_kv_heads <= 0 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_H
        || head_dim <= 0 || head_dim > MAX_D || num_heads / num_kv_heads * head_dim > MAX_HD
        || block_size <= 0 || num_threads <= 0 || query_start_loc[0] < 0 || query_start_loc[num_reqs] > num_q_tokens)
        return -1;
    /* Validate the plan first, so the parallel loop cannot read outside the cache. */
    for (int64_t r = 0; r < num_reqs; r++) {
        int64_t n = query_start_loc[r + 1] - query_start_loc[r], len = seq_lens[r];
        if (n < 0 || len < n || (len + block_size - 1) / block_size > max_blocks)
            return -1;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; b++)
            if (block_tables[r * max_blocks + b] < 0 || block_tables[r * max_blocks + b] >= num_blocks)
                return -1;
    }
    const int64_t G = num_heads / num_kv_heads, D = head_dim, row = num_kv_heads * head_dim;
    const int64_t num_tokens = query_start_loc[num_reqs] - query_start_loc[0];
    const float *v_all = kv_cache + num_blocks * block_size * row;
    /* KV heads per work item: a token's all (its K/V rows then stream whole from each block, and the hardware
       prefetcher follows them) once there are tokens enough to keep the threads busy, else one, for parallelism.
       Each head's arithmetic is the same either way, so the choice does not change any result. */
    const int64_t per_item = num_tokens >= 4 * num_threads && num_heads <= MAX_H && num_heads * D <= MAX_HD
                             ? num_kv_heads : 1;
    const int64_t NH = per_item * G, items_per_token = num_kv_heads / per_item;

    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_tokens * items_per_token; item++) {
        int64_t t = query_start_loc[0] + item / items_per_token, hk = item % items_per_token * per_item;
        int64_t lo = 0, hi = num_reqs - 1;          /* the request owning token t: last r with start <= t */
        while (lo < hi) {
            int64_t mid = (lo + hi + 1) / 2;
            if (query_start_loc[mid] <= t) lo = mid; else hi = mid - 1;
        }
        int64_t r = lo, n = query_start_loc[r + 1] - query_start_loc[r];
        int64_t num_keys = seq_lens[r] - n + (t - query_start_loc[r]) + 1;
        const float *qh = q + (t * num_heads + hk * G) * D;
        float *oh = out + (t * num_heads + hk * G) * D;
        const int32_t *table = block_tables + r * max_blocks;
        const float *k = kv_cache + hk * D, *v = v_all + hk * D;
        /* Constant head sizes let the compiler keep the accumulators in vector registers. */
        if (D == 64)
            attend_lanes(oh, qh, k, v, table, num_keys, NH, G, 64, block_size, row, scale);
        else if (D == 128)
            attend_lanes(oh, qh, k, v, table, num_keys, NH, G, 128, block_size, row, scale);
        else if (D % VL == 0)
            attend_lanes(oh, qh, k, v, table, num_keys, NH, G, D, block_size, row, scale);
        else
            attend(oh, qh, k, v, table, num_keys, NH, G, D, block_size, row, scale);
    }
    return 0;
}
