"""Unified paged attention: one launch for a flat batch mixing prompt chunks and single decode tokens.

The batch (see attention/metadata.py) is R requests; request r owns query tokens
[query_start_loc[r], query_start_loc[r+1]) and has seq_len[r] tokens of context including them, so its
queries sit at positions ctx_len .. seq_len - 1 (ctx_len = seq_len - query_len) and query i attends to keys
0 .. ctx_len + i (causal inside the chunk, everything earlier from the cache). K/V are read straight from the
paged cache through the block table: key j of request r lives in block block_tables[r, j // block_size],
slot j % block_size. Nothing is gathered into a contiguous copy.

Work split (the grid): each request's queries are cut into query tiles of BLOCK_Q tokens (planned on the host
once per step: tile_req / tile_qstart). A program handles one (query tile, KV head, split): its BLOCK_Q tokens
times the QPK query heads that share that KV head (GQA), i.e. a BLOCK_M = BLOCK_Q * QPK_P row block of Q, so
one load of a K/V tile serves all the heads of the group. It walks the keys in BLOCK_N-token tiles with an
online softmax in fp32.

    grid = (num_tiles, num_kv_heads, num_splits)

Per-layer variants (constexprs, so a plain layer compiles to exactly the kernel without them):
    SLIDING_WINDOW = W > 0   query at position p sees keys j with p - W < j <= p (transformers' sliding-window mask,
                             Mistral / Gemma 2-3 local layers); key tiles wholly before the tile's first window are
                             skipped, so a windowed layer reads O(W) keys, not O(context)
    USE_SOFTCAP              logits s = softcap * tanh(s / softcap) after the scale, before the mask (Gemma 2)

An FP8 cache (KV_FP8 1: e4m3, 2: e5m2; kv_cache_dtype.py) arrives as its bytes: each K/V tile is decoded exactly
(fp8_bytes.py) and multiplied by the layer's k_scale / v_scale, read from device scalars so a CUDA graph replays
whatever the layer holds.

Split-KV (flash-decoding): when a decode batch has too few programs to fill the GPU and the contexts are long,
each program takes 1/num_splits of the key tiles and writes an unnormalized partial (acc, max, sum); a second
kernel merges the splits per (token, head). The launcher picks num_splits (choose_num_splits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from steploop.gpu_worker import kv_cache_dtype
from steploop.gpu_worker.kernels.activations import tanh
from steploop.gpu_worker.kernels.fp8_bytes import e4m3_to_fp32, e5m2_to_fp32
from steploop.gpu_worker.kernels.launch_config import DEFAULT as DEFAULT_LAUNCH
from steploop.gpu_worker.kernels.launch_config import LaunchConfig, shape_class


@triton.jit
def kv_token_offsets(block_table_ptr, req, kv_pos, stride_bt, stride_cb, stride_cs,
                     BLOCK_SIZE: tl.constexpr, mask):
    """Element offset of key/value position kv_pos [N] of request req inside one layer's K (or V) cache,
    in int64: num_blocks * block_size * Hk * D can pass 2**31 elements on a large GPU."""
    blk = tl.load(block_table_ptr + req.to(tl.int64) * stride_bt + kv_pos // BLOCK_SIZE, mask=mask, other=0)
    return blk.to(tl.int64) * stride_cb + (kv_pos % BLOCK_SIZE).to(tl.int64) * stride_cs


# stride_bt is the step's block-table width: unspecialized, so a width of 1 or a multiple of 16 compiles no new
# variant mid-serving (the warm-up in tuning.py compiles each variant once)
@triton.jit(do_not_specialize=["stride_bt"])
def unified_attention_kernel(
    q_ptr,                 # [T, H, D] queries of the step's tokens (row strides given; last dim contiguous)
    k_cache_ptr,           # [num_blocks, block_size, Hk, D] this layer's K cache (kv_cache[0]; FP8: its bytes)
    v_cache_ptr,           # [num_blocks, block_size, Hk, D] this layer's V cache (kv_cache[1])
    k_scale_ptr,           # [1] fp32 FP8 K scale (read only with KV_FP8)
    v_scale_ptr,           # [1] fp32 FP8 V scale
    out_ptr,               # [T, H, D] output (not split)
    part_acc_ptr,          # [T, H, NUM_SPLITS, D] fp32 unnormalized partial outputs (split)
    part_m_ptr,            # [T, H, NUM_SPLITS] fp32 running max of each split (split)
    part_l_ptr,            # [T, H, NUM_SPLITS] fp32 sum of exp of each split (split)
    block_table_ptr,       # [R, max_blocks] int32 block ids
    seq_lens_ptr,          # [R] int32 context length incl. the new tokens
    query_start_loc_ptr,   # [R + 1] int32 first flat token of each request
    tile_req_ptr,          # [num_tiles] int32 request of each query tile
    tile_qstart_ptr,       # [num_tiles] int32 first query (index inside its request) of each tile
    scale,                 # softmax scale (fp32)
    softcap,               # logit soft-cap (fp32; read only with USE_SOFTCAP)
    num_heads,             # H
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,   # cache strides: block, slot, kv head
    stride_bt,                         # block table row stride
    QPK: tl.constexpr, QPK_P: tl.constexpr,             # query heads per KV head, rounded to a power of 2
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,   # head size, rounded to a power of 2
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IS_SPLIT: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,   # 0: full causal attention; W: keys p - W < j <= p
    USE_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,     # 0: the cache holds q's dtype; 1: e4m3 bytes; 2: e5m2 bytes (times the scales)
    DOT_FP32: tl.constexpr,   # upcast operands to fp32 before tl.dot (fp32 inputs; bf16 under the interpreter)
    DOT_PRECISION: tl.constexpr,   # "ieee" for fp32 inputs (no tf32 rounding), else "tf32" (ignored for 16-bit)
):
    BLOCK_M: tl.constexpr = BLOCK_Q * QPK_P
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(tile_req_ptr + tile)
    q_first = tl.load(tile_qstart_ptr + tile)
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_first + offs_m // QPK_P                        # [M] query index inside the request
    g = offs_m % QPK_P                                       # [M] head inside the GQA group
    head = kvh * QPK + g                                     # [M] query head
    row_ok = (q_idx < q_len) & (g < QPK)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    tok = (q_begin + q_idx).to(tl.int64)                     # [M] flat token
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = ctx_len + q_idx                                  # [M] position of each query row

    # keys this tile can see: up to its last query's position, from its first query's window on; in split mode,
    # this split's share of those key tiles
    kv_end = tl.minimum(seq_len, ctx_len + q_first + BLOCK_Q)
    num_kv_tiles = tl.cdiv(kv_end, BLOCK_N)
    first_tile = 0
    if SLIDING_WINDOW > 0:
        first_tile = tl.maximum(ctx_len + q_first - SLIDING_WINDOW + 1, 0) // BLOCK_N
    t_begin = first_tile
    t_end = num_kv_tiles
    if IS_SPLIT:
        per_split = tl.cdiv(num_kv_tiles - first_tile, NUM_SPLITS)
        t_begin = first_tile + split * per_split
        t_end = tl.minimum(t_begin + per_split, num_kv_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    head_off = kvh.to(tl.int64) * stride_ch
    if KV_FP8 > 0:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    for t in range(t_begin, t_end):
        kv_pos = t * BLOCK_N + tl.arange(0, BLOCK_N)         # [N]
        kv_ok = kv_pos < kv_end
        off = kv_token_offsets(block_table_ptr, req, kv_pos, stride_bt, stride_cb, stride_cs, BLOCK_SIZE,
                               kv_ok) + head_off             # [N] int64
        kv_mask = kv_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + offs_d[None, :], mask=kv_mask, other=0)   # [N, D]
        v = tl.load(v_cache_ptr + off[:, None] + offs_d[None, :], mask=kv_mask, other=0)   # [N, D]
        if KV_FP8 == 1:
            k = (e4m3_to_fp32(k) * k_scale).to(q.dtype)
            v = (e4m3_to_fp32(v) * v_scale).to(q.dtype)
        elif KV_FP8 == 2:
            k = (e5m2_to_fp32(k) * k_scale).to(q.dtype)
            v = (e5m2_to_fp32(v) * v_scale).to(q.dtype)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale   # [M, N] fp32
        if USE_SOFTCAP:
            s = softcap * tanh(s / softcap)
        visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        if SLIDING_WINDOW > 0:
            visible = visible & (q_pos[:, None] - kv_pos[None, :] < SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row that saw no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if IS_SPLIT:
        base = (tok * num_heads + head) * NUM_SPLITS + split  # [M]
        tl.store(part_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_m_ptr + base, m_i, mask=row_ok)
        tl.store(part_l_ptr + base, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def reduce_splits_kernel(
    out_ptr,          # [T, H, D] output
    part_acc_ptr,     # [T, H, NUM_SPLITS, D] fp32
    part_m_ptr,       # [T, H, NUM_SPLITS] fp32
    part_l_ptr,       # [T, H, NUM_SPLITS] fp32
    num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """grid = (T, H): merge the splits of one (token, head) with the log-sum-exp rule."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * num_heads + h) * NUM_SPLITS
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    m = tl.load(part_m_ptr + base + offs_s)
    l = tl.load(part_l_ptr + base + offs_s)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_max)                                    # [S]; an empty split weighs 0
    denom = tl.sum(w * l, 0)
    acc = tl.load(part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=d_ok[None, :],
                  other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@dataclass
class AttentionPlan:
    """Everything one step's launches need, built once per step and shared by all layers."""
    query_start_loc: torch.Tensor   # [R + 1] int32
    seq_lens: torch.Tensor          # [R] int32
    block_tables: torch.Tensor      # [R, max_blocks] int32
    tile_req: torch.Tensor          # [num_tiles] int32
    tile_qstart: torch.Tensor       # [num_tiles] int32
    num_tokens: int                 # T
    block_q: int                    # query tokens per tile
    num_splits: int                 # 1 = no split
    launch: LaunchConfig = DEFAULT_LAUNCH   # num_warps / num_stages of the attention launch (tuning.py)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def choose_block_q(qpk: int, max_query_len: int) -> int:
    """Query tokens per tile: a tile holds BLOCK_Q * QPK_P >= 16 rows (tl.dot needs 16); decode-only steps use
    the smallest such tile (one real token per tile), steps with prompt chunks about 64 rows."""
    rows = 16 if max_query_len <= 1 else 64
    return max(rows // _pow2(qpk), 1)


def choose_num_splits(num_programs: int, max_seq_len: int, max_query_len: int, num_sms: int) -> int:
    """Split the keys only for decode-only steps whose (tile, kv head) programs leave SMs idle and whose
    contexts are long enough (>= 256 keys per split) for the extra reduce launch to pay."""
    if max_query_len > 1 or num_programs >= num_sms:
        return 1
    by_occupancy = _pow2(-(-2 * num_sms // max(num_programs, 1)))
    by_length = 1 << max((max_seq_len // 256).bit_length() - 1, 0)
    return max(1, min(16, by_occupancy, by_length))


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8   # the interpreter: any fixed number; tests pass num_splits explicitly


def plan_tiles(query_lens_cpu: np.ndarray, num_heads: int, num_kv_heads: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Host half of the plan: cut each request's queries into tiles -> (tile_req [num_tiles] int32,
    tile_qstart [num_tiles] int32, block_q)."""
    qpk = num_heads // num_kv_heads
    block_q = choose_block_q(qpk, int(query_lens_cpu.max(initial=0)))
    tiles = -(-query_lens_cpu.astype(np.int64) // block_q)                 # [R] tiles per request
    tile_req = np.repeat(np.arange(len(tiles), dtype=np.int32), tiles)
    first_tile = np.repeat(np.cumsum(tiles) - tiles, tiles)
    tile_qstart = ((np.arange(len(tile_req)) - first_tile) * block_q).astype(np.int32)
    return tile_req, tile_qstart, block_q


def plan_attention(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   query_lens_cpu: np.ndarray, seq_lens_cpu: np.ndarray, num_heads: int, num_kv_heads: int,
                   num_splits: int | None = None, max_seq_len_hint: int | None = None,
                   tiles: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                   launch: LaunchConfig | dict[str, LaunchConfig] | None = None) -> AttentionPlan:
    """Plan of one step: cut each request's queries into tiles; pick the split count.
    max_seq_len_hint replaces the batch's longest context when choosing splits (CUDA graphs capture one).
    tiles: (tile_req, tile_qstart, block_q) already on the device (the step's staged copy); None: made here.
    launch: the launch config, or the tuned one per shape class (tuning.py; None: the default)."""
    device = seq_lens.device
    if tiles is None:
        tile_req_np, tile_qstart_np, block_q = plan_tiles(query_lens_cpu, num_heads, num_kv_heads)
        tiles = (torch.from_numpy(tile_req_np).to(device), torch.from_numpy(tile_qstart_np).to(device), block_q)
    tile_req, tile_qstart, block_q = tiles
    if num_splits is None:
        longest = max_seq_len_hint or int(seq_lens_cpu.max(initial=0))
        num_splits = choose_num_splits(tile_req.shape[0] * num_kv_heads, longest,
                                       int(query_lens_cpu.max(initial=0)), num_sms(device))
    if not isinstance(launch, LaunchConfig):
        cls = shape_class(int(query_lens_cpu.max(initial=0)), num_splits)
        launch = (launch or {}).get(cls, DEFAULT_LAUNCH)
    return AttentionPlan(query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
                         tile_req=tile_req, tile_qstart=tile_qstart, num_tokens=int(query_lens_cpu.sum()),
                         block_q=block_q, num_splits=num_splits, launch=launch)


def attention_constexprs(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, block_q: int,
                         num_splits: int, dtype: torch.dtype, interpret: bool, window: int | None = None,
                         softcap: float | None = None, kv_fp8: int = 0) -> dict:
    """The kernel's compile-time configuration for one launch (also used by the ahead-of-time compile test).
    window None = full causal attention (SLIDING_WINDOW 0); softcap None = no soft-capping; dtype is q's;
    kv_fp8: kv_cache_dtype.kernel_code of the cache (0: q's dtype)."""
    qpk = num_heads // num_kv_heads
    return {"QPK": qpk, "QPK_P": _pow2(qpk), "HEAD_DIM": head_dim, "HEAD_DIM_P": _pow2(head_dim), "BLOCK_SIZE": block_size,
                "BLOCK_Q": block_q, "BLOCK_N": 64 if head_dim <= 64 else 32, "NUM_SPLITS": num_splits,
                "IS_SPLIT": num_splits > 1, "SLIDING_WINDOW": window or 0, "USE_SOFTCAP": softcap is not None,
                "KV_FP8": kv_fp8,
                "DOT_FP32": dtype == torch.float32 or (interpret and dtype == torch.bfloat16),
                "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def _interpreting() -> bool:
    return triton.knobs.runtime.interpret


def unified_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, plan: AttentionPlan,
                      scale: float, window: int | None = None, softcap: float | None = None,
                      kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [T, H, D] (a view is fine: last dim contiguous), kv_cache [2, num_blocks, block_size, Hk, D],
    out [T, H, D] -> out. One launch (two with split-KV). window: keys p - window < j <= p (None: all j <= p);
    softcap: logits softcap * tanh(logits / softcap) (None: none). kv_scales: (k_scale, v_scale) one-element fp32
    device tensors, for an FP8 cache (and only for one)."""
    t, h, d = q.shape
    _, _, block_size, hk, dk = kv_cache.shape
    if kv_cache.shape[0] != 2 or dk != d or h % hk or out.shape != q.shape:
        raise ValueError(f"shapes: q {tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)}, out {tuple(out.shape)}")
    kv_fp8 = kv_cache_dtype.kernel_code(kv_cache.dtype)
    if (q.dtype != kv_cache.dtype and not kv_fp8) or out.dtype != q.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, kv_cache {kv_cache.dtype}, out {out.dtype}")
    if bool(kv_fp8) != (kv_scales is not None) or (kv_scales is not None and any(
            s.dtype != torch.float32 or s.numel() != 1 or s.device != q.device for s in kv_scales)):
        wanted = f"one-element fp32 K/V scales on {q.device}" if kv_fp8 else "no scales"
        raise ValueError(f"a {kv_cache.dtype} cache takes {wanted}")
    if q.stride(-1) != 1 or out.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("q/out need a contiguous last dim and kv_cache must be contiguous")
    if t != plan.num_tokens or plan.block_tables.dtype != torch.int32 or plan.seq_lens.dtype != torch.int32:
        raise ValueError(f"plan for {plan.num_tokens} tokens (int32 tables/lens) used for {t} tokens")
    if (window is not None and window < 1) or (softcap is not None and not softcap > 0):
        raise ValueError(f"window {window} must be >= 1 and softcap {softcap} > 0 (None: off)")
    if t == 0:
        return out
    c = attention_constexprs(h, hk, d, block_size, plan.block_q, plan.num_splits, q.dtype, _interpreting(),
                             window, softcap, kv_fp8)
    if kv_fp8:
        kv_cache = kv_cache.view(torch.uint8)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_scale, v_scale = kv_scales if kv_scales is not None else (out, out)    # unread without KV_FP8
    parts = [out, out, out]    # unused pointers when not split
    if plan.num_splits > 1:
        parts = [torch.empty((t, h, plan.num_splits, d), dtype=torch.float32, device=q.device),
                 torch.empty((t, h, plan.num_splits), dtype=torch.float32, device=q.device),
                 torch.empty((t, h, plan.num_splits), dtype=torch.float32, device=q.device)]
    grid = (plan.tile_req.shape[0], hk, plan.num_splits)
    unified_attention_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, out, *parts, plan.block_tables, plan.seq_lens, plan.query_start_loc,
        plan.tile_req, plan.tile_qstart, scale, softcap or 1.0, h, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), plan.block_tables.stride(0), **c,
        num_warps=plan.launch.num_warps, num_stages=plan.launch.num_stages)
    if plan.num_splits > 1:
        reduce_splits_kernel[(t, h)](out, *parts, h, out.stride(0), out.stride(1), HEAD_DIM=d,
                                     HEAD_DIM_P=c["HEAD_DIM_P"], NUM_SPLITS=plan.num_splits)
    return out
