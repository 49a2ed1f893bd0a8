"""Slow, obvious torch references for every kernel in this package: per-request loops, fp32 math, no tricks.
Tests compare each kernel with its reference; nothing in serving calls these."""

from __future__ import annotations

import torch


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                        block_tables: torch.Tensor, scale: float, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """q [T, H, D]; kv_cache [2, num_blocks, block_size, Hk, D]; block_tables [R, max_blocks] -> [T, H, D].
    window: query at p sees keys p - window < j <= p (transformers' sliding window); softcap: logits
    softcap * tanh(logits / softcap) before the mask, as Gemma 2's eager attention."""
    block_size, hk = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // hk
    out = torch.empty_like(q)
    start = 0
    for r, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(seq_len)
        slots = block_tables[r].long().cpu()[pos // block_size] * block_size + pos % block_size
        flat = kv_cache.reshape(2, -1, hk, kv_cache.shape[-1])[:, slots.to(kv_cache.device)].float()
        k = flat[0].repeat_interleave(group, dim=1)              # [seq_len, H, D]
        v = flat[1].repeat_interleave(group, dim=1)
        qr = q[start:start + q_len].float()                       # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", qr, k) * scale      # [H, q_len, seq_len]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = seq_len - q_len + torch.arange(q_len)
        visible = pos[None, :] <= q_pos[:, None]                  # [q_len, seq_len]
        if window is not None:
            visible &= q_pos[:, None] - pos[None, :] < window
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
        start += q_len
    return out


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    block_size = kv_cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            kv_cache[0, slot // block_size, slot % block_size] = k[t]
            kv_cache[1, slot // block_size, slot % block_size] = v[t]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def rotary_neox_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place, in fp32: x * cos + rotate_half(x) * sin."""
    c = cos[positions].float().unsqueeze(1)
    s = sin[positions].float().unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return (x.float() * c + torch.cat((-x2, x1), dim=-1) * s).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
    """x [T, hidden], w13 [E, 2I, hidden] (gate rows, then up rows), w2 [E, hidden, I], topk [T, k] -> [T, hidden]:
    per token, per slot, in fp32: weight * w2_e @ (act(gate_e @ x) * (up_e @ x))."""
    act = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
           "gelu_tanh": lambda h: torch.nn.functional.gelu(h, approximate="tanh")}[activation]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for weight, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            out[t] += weight * (w2[e].float() @ (act(gate) * up))
    return out.to(x.dtype)
