"""Fused mixture-of-experts MLP (Mixtral, Qwen-MoE) as vLLM's fused_moe does it: the (token, expert) pairs sorted by
expert and padded per expert to the GEMM's row block, then one grouped-GEMM launch over all experts per projection.

    pairs:            T tokens x top_k slots, flat index i = token * top_k + slot, expert topk_ids[token, slot]
    align (torch):    sorted_ids  = the pair indices grouped by expert, each expert's run padded with T * top_k
                                    (a row the kernel skips) to a multiple of BLOCK_M
                      block_expert = the expert of each BLOCK_M rows of sorted_ids; num_padded = the rows in use
    launch 1 (w13):   inter[i] = act(x[i // top_k] @ gate_e.T) * (x[i // top_k] @ up_e.T)     [T * top_k, I]
                      the GLU fused into the GEMM: one program keeps both the gate and the up accumulator
    launch 2 (w2):    down[i] = weight[i] * (inter[i] @ w2_e.T)                                 [T * top_k, hidden]
    sum (torch):      out[token] = sum over its top_k slots, in fp32

    grid = (len(sorted_ids) / BLOCK_M, cdiv(N, BLOCK_N)); a program owns BLOCK_M sorted rows (one expert) x BLOCK_N
    output columns and walks K in BLOCK_K steps; programs past num_padded return at once.

The alignment is sized for the worst case (every expert present gets a partial block) and built from torch ops
that do not wait on the device (no bincount, unique or .item()), so the shapes depend only on T and the whole MoE
layer can be captured in a CUDA graph (the torch loop in model/moe.py cannot: it reads the experts on the host).
Weights: w13 [E, 2I, hidden] (gate rows, then up rows), w2 [E, hidden, I], as model/moe.py holds them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from steploop.gpu_worker.kernels.activations import activate

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


@triton.jit
def fused_moe_kernel(
    a_ptr,               # [rows, K] the GEMM's input: x (row = pair // TOP_K) or the activated inter (row = pair)
    b_ptr,               # [E, N or 2N, K] expert weights (w13 with GLU: gate rows 0..N-1, up rows N..2N-1; w2)
    c_ptr,               # [T * top_k, N] output per pair
    topk_weights_ptr,    # [T * top_k] fp32 routing weight per pair (MUL_ROUTED_WEIGHT)
    sorted_ids_ptr,      # [EM] int32 pair indices grouped by expert, padded with num_pairs
    block_expert_ptr,    # [EM / BLOCK_M] int32 expert of each row block
    num_padded_ptr,      # [1] int32 rows of sorted_ids in use
    N, K, num_pairs,
    stride_am, stride_be, stride_bn, stride_cm,
    TOP_K: tl.constexpr,                # pairs per row of a (top_k for launch 1, 1 for launch 2)
    GLU: tl.constexpr,                  # c = act(a @ gate.T) * (a @ up.T), else c = a @ b.T
    ACTIVATION: tl.constexpr,           # "silu", "gelu", "gelu_tanh" (with GLU)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,             # upcast operands before tl.dot (fp32 inputs; bf16 under the interpreter)
    DOT_PRECISION: tl.constexpr,        # "ieee" for fp32 inputs (no tf32 rounding), else "tf32"
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)                              # [M]
    row_ok = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // TOP_K).to(tl.int64)[:, None] * stride_am + offs_k[None, :]           # [M, K]
    b_ptrs = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GLU:
            up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if DOT_FP32:
                up = up.to(tl.float32)
            acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if GLU:
        acc = activate(acc, ACTIVATION) * acc_up
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per program: 16 (the least tl.dot takes) while experts get few pairs each (decode), else 64."""
    return 16 if num_pairs < 16 * num_experts else 64


def moe_constexprs(top_k: int, glu: bool, activation: str, routed: bool, block_m: int, dtype: torch.dtype,
                   interpret: bool) -> dict:
    """The kernel's compile-time configuration for one launch (also used by the ahead-of-time compile test)."""
    return {"TOP_K": top_k, "GLU": glu, "ACTIVATION": activation, "MUL_ROUTED_WEIGHT": routed, "BLOCK_M": block_m,
            "BLOCK_N": 64, "BLOCK_K": 32 if dtype == torch.float32 else 64,
            "DOT_FP32": dtype == torch.float32 or (interpret and dtype == torch.bfloat16),
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> sorted_ids [EM] int32, block_expert [EM / block_m] int32, num_padded [1] int32.

    sorted_ids lists the pair indices of expert 0, then expert 1, ..., each run padded with T * k to a multiple
    of block_m; EM = the padded length when every expert holding a pair has a partial block (fixed given T).
    An id equal to num_experts is a pair no expert here takes (expert parallel: another rank's expert): it is in
    no run, so the kernel never touches its rows."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    em = -(-(num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m) * block_m
    counts_all = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))                                        # [E + 1] (bincount syncs on CUDA)
    counts = counts_all[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = torch.cumsum(padded, 0)                                          # end of each expert's run
    order = torch.argsort(flat, stable=True)                                   # pairs by expert, in token order
    sorted_expert = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts_all, 0) - counts_all)[sorted_expert]
    run_start = torch.cat([run_end - padded, run_end.new_full((1,), em)])     # the skipped pairs: slot em, dropped
    dest = torch.where(sorted_expert < num_experts, run_start[sorted_expert] + rank, em)
    sorted_ids = torch.full((em + 1,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(0, em, block_m, device=flat.device)
    block_expert = torch.searchsorted(run_end, block_start, right=True).clamp_(max=num_experts - 1)
    return sorted_ids[:em], block_expert.to(torch.int32), run_end[-1:].to(torch.int32)


def _launch(a, b, c, weights, align, block_m: int, n: int, k: int, top_k: int, activation: str | None):
    """activation None: the down projection (plain GEMM, routing weight applied); else the GLU up projection."""
    sorted_ids, block_expert, num_padded = align
    glu = activation is not None
    consts = moe_constexprs(top_k, glu, activation or "", not glu, block_m, a.dtype, triton.knobs.runtime.interpret)
    grid = (block_expert.numel(), triton.cdiv(n, consts["BLOCK_N"]))
    fused_moe_kernel[grid](a, b, c, weights, sorted_ids, block_expert, num_padded, n, k, c.shape[0],
                           a.stride(0), b.stride(0), b.stride(1), c.stride(0), **consts)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str, first_expert: int | None = None) -> torch.Tensor:
    """x [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I], topk_weights/topk_ids [T, k] -> [T, hidden]:
    sum over slots of weight * w2_e(act(gate_e x) * up_e x). Two grouped-GEMM launches (see the module doc).

    A tensor-parallel rank passes its shards (I / N rows and columns of every expert): the result is its partial
    sum. first_expert (expert parallel): w13 / w2 hold experts [first_expert, first_expert + E) of the router's;
    pairs routed elsewhere add nothing here."""
    t, hidden = x.shape
    e, two_i, _ = w13.shape
    top_k = topk_ids.shape[-1]
    if w13.shape[2] != hidden or two_i % 2 or w2.shape != (e, hidden, two_i // 2) or topk_weights.shape != (t, top_k) \
            or topk_ids.shape != (t, top_k):
        raise ValueError(f"shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
                         f"topk {tuple(topk_weights.shape)} / {tuple(topk_ids.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"dtypes differ: x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if t == 0:
        return torch.empty_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    if first_expert is not None:
        local = topk_ids - first_expert
        topk_ids = torch.where((local >= 0) & (local < e), local, e)     # e: held by another rank, skipped
    inter_size = two_i // 2
    block_m = choose_block_m(t * top_k, e)
    align = moe_align_block_size(topk_ids, block_m, e)
    weights = topk_weights.reshape(-1).to(torch.float32)
    inter = torch.empty((t * top_k, inter_size), dtype=x.dtype, device=x.device)
    _launch(x, w13, inter, weights, align, block_m, inter_size, hidden, top_k, activation)
    # a skipped pair's row is never written: zero it for the sum
    down = (torch.empty if first_expert is None else torch.zeros)((t * top_k, hidden), dtype=x.dtype, device=x.device)
    _launch(inter, w2, down, weights, align, block_m, hidden, inter_size, 1, None)
    return down.view(t, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)
