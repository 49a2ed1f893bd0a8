"""At start, time the packed-weight matmul against torch's fp32 matmul on the model's own layer shapes, so the
default path is never much slower than plain torch on a CPU the kernels were not tuned for.

    result = probe_packed_linear(layer_shapes(cfg))
    result.use_packed, result.describe()      # the choice, and both figures for the log

A probe "pass" is what a forward does with one layer's weights (qkv, o, gate_up, down) for several layers of
distinct weights (so they come from memory, as in serving, not from cache), at a few batch sizes (1 and 64 rows:
one stream and a full decode batch). The weights are constant (fp32 for torch, Q4_1 nibbles and scales for the
kernel): the speed of either path does not depend on the values. Both run on one thread and are timed in that thread's CPU time: what
is compared is the code on this CPU, and a machine shared with busy neighbours (which stretch wall-clock time by
whole scheduler slices) does not decide it. torch and packed alternate round by round and the best round of each
counts. The packed kernel is kept unless torch is faster by PREFER_TORCH over
the geometric mean of the sizes' ratios: ties go to the kernel, whose weights take ~5x less memory.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from steploop.gpu_worker.cpu_kernels import packed_linear as kernel
from steploop.gpu_worker.cpu_kernels.packed_weights import GROUP, Q4_1, QK, PackedWeight, packable_shape

ROWS = (1, 64)             # batch sizes timed: one decode stream, a full batch of 64
ROUNDS = 3                 # alternating rounds per batch size (best of each)
STREAM_BYTES = 48 << 20    # at least this much fp32 weight per pass (more than one core's share of L3), ...
MAX_LAYERS = 8             # ... from at most this many layers' worth of distinct weights
# Each probed shape is capped at this many rows and columns (both on the packed grid): a big model's layer (8B:
# ~0.9 GB of fp32, 70B: ~3.4 GB) would otherwise be allocated and multiplied at every start, while the speed per
# weight of either path is already what it is at this size (past L2 and a core's share of L3 either way).
MAX_DIM = 4096
PREFER_TORCH = 1.1         # torch must be this much faster (geometric mean) to take the place of the kernel


@dataclass(frozen=True)
class ProbeResult:
    rows: tuple[int, ...]
    packed_ms: tuple[float, ...]     # best pass per batch size, one thread's CPU time
    torch_ms: tuple[float, ...]
    seconds: float                   # the probe's own wall time

    @property
    def speedup(self) -> float:
        """Geometric mean over the batch sizes of torch time / packed time (> 1: the kernel is faster)."""
        return math.exp(sum(math.log(t / p) for t, p in zip(self.torch_ms, self.packed_ms)) / len(self.rows))

    @property
    def use_packed(self) -> bool:
        return self.speedup * PREFER_TORCH >= 1.0

    def describe(self) -> str:
        sizes = ", ".join(f"{m} rows {p:.1f} vs {t:.1f} ms" for m, p, t in zip(self.rows, self.packed_ms,
                                                                           self.torch_ms))
        return (f"packed vs torch fp32 matmuls on the model's layer shapes: {sizes} ({self.speedup:.2f}x, probe "
                f"{self.seconds:.2f} s, one thread's CPU time)")


def layer_shapes(cfg) -> list[tuple[int, int]]:
    """[(out_features, in_features)] of one decoder layer's linears, fused as the worker's model has them, that
    the packed layout can hold (the others never pack, so they stay torch's whatever the probe finds); may be
    empty."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = [((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, h), (h, cfg.num_attention_heads * d),
              (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    return [(n, k) for n, k in shapes if packable_shape(n, k)]


def _packed_q4_1(n: int, k: int) -> PackedWeight:
    """A Q4_1 weight in the kernel's layout (packed_weights.py); filled, so its pages are real memory."""
    qs = torch.full((n // GROUP, k // 2, GROUP), 0x5A, dtype=torch.uint8)
    d = torch.full((n // GROUP, k // QK, GROUP), 0.01)
    return PackedWeight(Q4_1, qs, d, torch.full_like(d, -0.08), n, k)


def _weights(shapes: list[tuple[int, int]]) -> tuple[list[torch.Tensor], list[PackedWeight]]:
    """fp32 weights and packed ones of these shapes (capped at MAX_DIM), enough layers' worth that a pass streams
    from memory."""
    shapes = [(min(n, MAX_DIM), min(k, MAX_DIM)) for n, k in shapes]
    layer_bytes = sum(n * k * 4 for n, k in shapes)
    layers = max(1, min(MAX_LAYERS, math.ceil(STREAM_BYTES / layer_bytes)))
    weights = [torch.full((n, k), 0.01) for _ in range(layers) for n, k in shapes]
    return weights, [_packed_q4_1(n, k) for _ in range(layers) for n, k in shapes]


def _best_pass(fns: list, best: float) -> float:
    start = time.thread_time()
    for fn in fns:
        fn()
    return min(best, time.thread_time() - start)


def probe_packed_linear(shapes: list[tuple[int, int]], rows: tuple[int, ...] = ROWS,
                        rounds: int = ROUNDS) -> ProbeResult:
    """Time both paths on these (out, in) shapes (each one packable_shape), one thread each; the kernel's library
    must be available."""
    start = time.perf_counter()
    weights, packed = _weights(shapes)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        packed_ms, torch_ms = _time_paths(weights, packed, rows, rounds)
    finally:
        torch.set_num_threads(threads)
    return ProbeResult(tuple(rows), tuple(packed_ms), tuple(torch_ms), time.perf_counter() - start)


def _time_paths(weights: list[torch.Tensor], packed: list[PackedWeight], rows: tuple[int, ...],
                rounds: int) -> tuple[list[float], list[float]]:
    packed_ms, torch_ms = [], []
    for m in rows:
        xs = [torch.randn(m, w.shape[1]) for w in weights]
        outs = [torch.empty(m, w.shape[0]) for w in weights]
        torch_fns = [lambda x=x, w=w, y=y: torch.matmul(x, w.T, out=y) for x, w, y in zip(xs, weights, outs)]
        packed_fns = [lambda x=x, p=p, y=y: kernel.packed_linear(x, p, 1, out=y)
                      for x, p, y in zip(xs, packed, outs)]
        for fn in (torch_fns[0], packed_fns[0]):          # first calls: thread pools, buffers
            fn()
        best_torch = best_packed = float("inf")
        for _ in range(rounds):
            best_torch = _best_pass(torch_fns, best_torch)
            best_packed = _best_pass(packed_fns, best_packed)
        torch_ms.append(best_torch * 1e3)
        packed_ms.append(best_packed * 1e3)
    return packed_ms, torch_ms
