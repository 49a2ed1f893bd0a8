/* Every decoder layer of a Llama-family model in one call, on the CPU in fp32, for steps whose attention the C
   kernel computes whole (decodes, short chunks, prompt chunks over short contexts): the same kernels model/llama.py calls one by one through CpuOps and
   PackedLinear, in the same order on the same buffers, so the result is bit for bit the Python path's. What it
   saves is the Python between them: ~15 ctypes calls and ~40 torch ops per layer, ~5 ms of a decode step on 2 cores.

   Per layer: [residual +=] x; x = rms_norm(residual); qkv = x @ Wqkv; rotary(q, k); K/V written at their slots;
   attention over the paged cache (q copied out of qkv first: the kernel wants [T, H, D]); x = attn @ Wo;
   residual += x; x = rms_norm(residual); x = silu(x @ Wgate) * (x @ Wup); x = x @ Wdown.
   Layer 0 takes x as the residual (no add), as LlamaDecoderLayer does. */

#include <stdint.h>
#include <string.h>

int steploop_packed_linear(float *y, const float *x, const void *qs, const float *d, const float *m, int64_t M,
                           int64_t N, int64_t K, int kind, int num_threads);
int steploop_packed_linear_q8b(float *y, const float *x, const int8_t *qs, const float *d, const float *m,
                               int64_t M, int64_t N, int64_t K, int bs, int num_threads);
/* packed_weights.py kinds beyond Q4_1 / Q8_0: int8 blocks (q8b: GGUF Q5_1, or fused parts of mixed types), and
   the GGUF k-quants at their width (Q4_K, Q5_K, Q6_K) */
int steploop_packed_linear_q4k(float *y, const float *x, const uint8_t *qs, const float *dd, const uint8_t *scales,
                               int64_t M, int64_t N, int64_t K, int num_threads);
int steploop_packed_linear_kquant(float *y, const float *x, const uint8_t *qs, const float *dd, const uint8_t *scales,
                                  int64_t M, int64_t N, int64_t K, int q6, int num_threads);
/* and 16-bit weights (a bf16 / fp16 checkpoint's, widened exactly) */
int steploop_packed_linear_w16(float *y, const float *x, const uint16_t *w, int64_t M, int64_t N, int64_t K, int f16,
                               int num_threads);
enum { KIND_Q8_1 = 200, KIND_Q8_0_16 = 201, KIND_Q8_1_16 = 202, KIND_Q4_K = 203, KIND_Q5_K = 204, KIND_Q6_K = 205,
       KIND_BF16 = 207, KIND_F16 = 208 };
int steploop_rms_norm(float *y, float *x, float *residual, const float *w, int64_t T, int64_t H, float eps,
                      int num_threads);
int steploop_rotary_neox(float *q, float *k, const int64_t *positions, const float *cos_table,
                         const float *sin_table, int64_t T, int64_t Hq, int64_t Hk, int64_t D, int64_t q_row,
                         int64_t k_row, int64_t P, int num_threads);
int steploop_silu_and_mul(float *out, const float *x, int64_t T, int64_t I, int num_threads);
int steploop_paged_attention(float *out, const float *q, const float *kv_cache, const int32_t *block_tables,
                             const int32_t *query_start_loc, const int32_t *seq_lens, int64_t num_q_tokens,
                             int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t num_blocks, int64_t block_size, int64_t max_blocks, float scale,
                             int num_threads);

typedef struct PackedMatrix {
    const void *qs;
    const float *d, *m;
    int64_t out_features, in_features;
    int64_t kind;
    const struct PackedMatrix *next;          /* the rows after these, in another form (packed_weights.py SPLIT) */
} PackedMatrix;

typedef struct {
    const float *input_norm, *post_norm;      /* [hidden] */
    PackedMatrix qkv, o, gate_up, down;
    float *kv_cache;                          /* [2, num_blocks, block_size, Hk, D] */
} Layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, num_blocks, block_size;
    int64_t max_positions;
    float eps, scale;
    const Layer *layers;
    const float *cos, *sin;                   /* [max_positions, head_dim] */
} Model;

typedef struct {
    int64_t num_tokens, num_reqs, max_blocks;
    const int64_t *positions, *slot_mapping;  /* [num_tokens] */
    const int32_t *block_tables;              /* [num_reqs, max_blocks] */
    const int32_t *query_start_loc;           /* [num_reqs + 1] */
    const int32_t *seq_lens;                  /* [num_reqs] */
} Step;

/* all the rows of a matrix and of the parts after it */
static int64_t rows(const PackedMatrix *w)
{
    return w->out_features + (w->next ? rows(w->next) : 0);
}

/* the most rows of one part of a matrix held in parts (0 when none is): the floats per token a part's output
   needs before it is placed in its columns */
static int64_t part_rows(const Model *model)
{
    int64_t most = 0;
    for (int64_t l = 0; l < model->num_layers; l++) {
        const Layer *layer = &model->layers[l];
        const PackedMatrix *ws[4] = {&layer->qkv, &layer->o, &layer->gate_up, &layer->down};
        for (int i = 0; i < 4; i++)
            for (const PackedMatrix *p = ws[i]; ws[i]->next && p; p = p->next)
                most = p->out_features > most ? p->out_features : most;
    }
    return most;
}

/* floats of scratch steploop_decoder_forward needs for T tokens */
int64_t steploop_decoder_scratch(const Model *model, int64_t T)
{
    int64_t qd = model->num_heads * model->head_dim;
    return T * (rows(&model->layers[0].qkv) + 2 * qd + 3 * model->intermediate + part_rows(model));
}

static int linear_part(float *y, const float *x, const PackedMatrix *w, int64_t T, int num_threads)
{
    if (w->kind == KIND_BF16 || w->kind == KIND_F16)
        return steploop_packed_linear_w16(y, x, w->qs, T, w->out_features, w->in_features, w->kind == KIND_F16,
                                          num_threads);
    if (w->kind == KIND_Q4_K)
        return steploop_packed_linear_q4k(y, x, w->qs, w->d, (const uint8_t *)w->m, T, w->out_features,
                                          w->in_features, num_threads);
    if (w->kind == KIND_Q5_K || w->kind == KIND_Q6_K)
        return steploop_packed_linear_kquant(y, x, w->qs, w->d, (const uint8_t *)w->m, T, w->out_features,
                                             w->in_features, w->kind == KIND_Q6_K, num_threads);
    if (w->kind == KIND_Q8_1 || w->kind == KIND_Q8_0_16 || w->kind == KIND_Q8_1_16)
        return steploop_packed_linear_q8b(y, x, w->qs, w->d, w->kind == KIND_Q8_0_16 ? NULL : w->m, T,
                                          w->out_features, w->in_features, w->kind == KIND_Q8_1 ? 32 : 16,
                                          num_threads);
    return steploop_packed_linear(y, x, w->qs, w->d, w->m, T, w->out_features, w->in_features, (int)w->kind,
                                  num_threads);
}

/* y [T, rows(w)] = x @ W.T; a matrix in parts runs each part's kernel into its columns (one token: straight into
   y; more: into `part`, then row by row into place) */
static int linear(float *y, const float *x, const PackedMatrix *w, int64_t T, float *part, int num_threads)
{
    if (!w->next)
        return linear_part(y, x, w, T, num_threads);
    int64_t N = rows(w), col = 0;
    int rc = 0;
    for (const PackedMatrix *p = w; p; col += p->out_features, p = p->next) {
        if (T == 1) {
            rc |= linear_part(y + col, x, p, 1, num_threads);
            continue;
        }
        rc |= linear_part(part, x, p, T, num_threads);
        for (int64_t t = 0; t < T; t++)
            memcpy(y + t * N + col, part + t * p->out_features, (size_t)p->out_features * sizeof(float));
    }
    return rc;
}

/* x [T, hidden]: the embeddings in, the last layer's MLP output out; residual [T, hidden]: the residual stream out
   (the caller adds the two and applies the final norm). Returns 0, or -1 (bad sizes, a slot or position out of
   range, a failed allocation inside a kernel); x and residual are then undefined. */
int steploop_decoder_forward(const Model *model, const Step *step, float *x, float *residual, float *scratch,
                             int num_threads)
{
    const int64_t T = step->num_tokens, H = model->hidden, Hq = model->num_heads, Hk = model->num_kv_heads;
    const int64_t D = model->head_dim, I = model->intermediate, qkv_n = rows(&model->layers[0].qkv);
    const int64_t slots = model->num_blocks * model->block_size, kv_row = Hk * D;
    if (T <= 0 || qkv_n != (Hq + 2 * Hk) * D)
        return -1;
    for (int64_t t = 0; t < T; t++)
        if (step->slot_mapping[t] < 0 || step->slot_mapping[t] >= slots)
            return -1;
    float *qkv = scratch, *q = qkv + T * qkv_n, *attn = q + T * Hq * D, *gate_up = attn + T * Hq * D;
    float *act = gate_up + T * 2 * I, *part = act + T * I;
    int rc = 0;
    for (int64_t l = 0; l < model->num_layers && !rc; l++) {
        const Layer *layer = &model->layers[l];
        if (l == 0) {
            memcpy(residual, x, (size_t)(T * H) * sizeof(float));
            rc |= steploop_rms_norm(x, residual, NULL, layer->input_norm, T, H, model->eps, num_threads);
        } else {
            rc |= steploop_rms_norm(x, x, residual, layer->input_norm, T, H, model->eps, num_threads);
        }
        rc |= linear(qkv, x, &layer->qkv, T, part, num_threads);
        rc |= steploop_rotary_neox(qkv, qkv + Hq * D, step->positions, model->cos, model->sin, T, Hq, Hk, D, qkv_n,
                                   qkv_n, model->max_positions, num_threads);
        if (rc)
            break;
        float *k_cache = layer->kv_cache, *v_cache = layer->kv_cache + slots * kv_row;
        for (int64_t t = 0; t < T; t++) {
            const float *row = qkv + t * qkv_n;
            memcpy(q + t * Hq * D, row, (size_t)(Hq * D) * sizeof(float));
            memcpy(k_cache + step->slot_mapping[t] * kv_row, row + Hq * D, (size_t)kv_row * sizeof(float));
            memcpy(v_cache + step->slot_mapping[t] * kv_row, row + Hq * D + kv_row, (size_t)kv_row * sizeof(float));
        }
        rc |= steploop_paged_attention(attn, q, layer->kv_cache, step->block_tables, step->query_start_loc,
                                       step->seq_lens, T, step->num_reqs, Hq, Hk, D, model->num_blocks,
                                       model->block_size, step->max_blocks, model->scale, num_threads);
        rc |= linear(x, attn, &layer->o, T, part, num_threads);
        rc |= steploop_rms_norm(x, x, residual, layer->post_norm, T, H, model->eps, num_threads);
        rc |= linear(gate_up, x, &layer->gate_up, T, part, num_threads);
        rc |= steploop_silu_and_mul(act, gate_up, T, I, num_threads);
        rc |= linear(x, act, &layer->down, T, part, num_threads);
    }
    return rc ? -1 : 0;
}
