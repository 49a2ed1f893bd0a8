"""HalfWeights: a bf16 or fp16 checkpoint's linears kept at 16 bits on the CPU (the loader's side; model/loader.py).

    half = HalfWeights.prepare(model, cfg, files, our_name, target_of)   # on meta, from the safetensors headers
    ... model.to_empty(); per checkpoint tensor: half.put(target, rows, tensor) if half.take(target), else dense ...
    log.info(half.check_done())

The CPU computes in fp32 (exact against transformers fp32 on the same upcast weights), and reading a 16-bit weight as
an fp32 one made a bf16 checkpoint take twice its file size in memory, and a decode step read twice the bytes it
needed. Here each PackedLinear whose checkpoint parts are all bf16 (or all fp16) holds the stored bits in the 16-bit
packed form (cpu_kernels/packed_weights.py BF16 / F16) and packed_linear.c widens them exactly to fp32 as it
multiplies: the same weights, the same fp32 arithmetic (one fma chain over k per output, as every packed form), half
the bytes. The layer never gets an fp32 weight: its parameter is dropped on meta, before the model is allocated.

A layer stays an fp32 nn.Linear weight (as before) when its parts mix dtypes or are fp32, or its rows are not whole
groups of 16 (the layout's). A 16-bit embedding table stays 16-bit too (HalfEmbedding, in the same layout), and a tied
lm_head multiplies by that very tensor. Mixture-of-experts experts stay in the model's dtype (fp32).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import torch
from safetensors import safe_open
from torch import nn

from steploop.gpu_worker.cpu_kernels.packed_weights import (GROUP, KIND_NAMES, W16_DTYPES, PackedWeight, empty_w16,
                                                               pack_w16, w16_rows)
from steploop.gpu_worker.model.packed_linear_layer import PackedLinear

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16}
_TABLE = "model.embed_tokens.weight"


def holds_16bit(files: list[pathlib.Path]) -> bool:
    """Whether any tensor of the checkpoint is stored bf16 / fp16 (from the safetensors headers)."""
    for file in files:
        with safe_open(file, framework="pt") as f:
            if any(f.get_slice(name).get_dtype() in _DTYPES for name in f.keys()):
                return True
    return False


class HalfEmbedding(nn.Module):
    """An embedding table kept as its checkpoint's 16-bit values, in the 16-bit packed layout ([V/16, K, 16]), so a
    tied lm_head multiplies by the very same tensor; a lookup gathers its rows and widens them (exact)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.packed: PackedWeight | None = None        # filled by HalfWeights.put

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.packed.qs[ids // GROUP, :, ids % GROUP]          # [*ids, K] int16: the rows' stored bits
        return rows.view(W16_DTYPES[self.packed.kind]).float()

    def extra_repr(self) -> str:
        kind = KIND_NAMES[self.packed.kind] if self.packed else "16-bit"
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind}"


class _Layer:
    def __init__(self, linear: PackedLinear, dtype: torch.dtype, parts: int):
        self.linear, self.dtype, self.parts = linear, dtype, parts
        self.packed: PackedWeight | None = None
        self.filled: set[tuple[int, int]] = set()


class HalfWeights:
    def __init__(self):
        self.layers: dict[str, _Layer] = {}        # our weight name (…qkv_proj.weight) -> the layer it fills
        self.table: HalfEmbedding | None = None    # the embedding, when its table is stored 16-bit
        self.table_dtype: torch.dtype | None = None
        self.tied_head: PackedLinear | None = None  # a tied lm_head that multiplies by the table's 16-bit rows

    @classmethod
    def prepare(cls, model: nn.Module, cfg, files: list[pathlib.Path], our_name: Callable[[str], str | None],
                target_of: Callable) -> HalfWeights | None:
        """Reads the headers; every PackedLinear whose parts are all stored bf16 (or all fp16) in whole groups of 16
        rows, and a 16-bit embedding table, lose their fp32 parameters here (on meta) and are filled by put(). None
        when nothing qualifies.
        our_name: checkpoint name -> ours (None: not this model's, e.g. another pipeline stage's);
        target_of: the loader's name -> (parameter, expert, row slice) map."""
        linears = {name + ".weight": m for name, m in model.named_modules() if isinstance(m, PackedLinear)}
        table_dtype = None
        found: dict[str, list[tuple[tuple[int, int] | None, str]]] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for stored in f.keys():
                    name = our_name(stored)
                    if name == _TABLE:
                        table_dtype = _DTYPES.get(f.get_slice(stored).get_dtype())
                    if name is None or not name.endswith(".weight") or \
                            (name == "lm_head.weight" and cfg.tie_word_embeddings):     # a tied head is the table's
                        continue
                    target, expert, rows = target_of(name, cfg)
                    if expert is None and target in linears:
                        found.setdefault(target, []).append((rows, f.get_slice(stored).get_dtype()))
        self = cls()
        embed, head = model.model.embed_tokens, getattr(model, "lm_head", None)
        if table_dtype is not None and isinstance(embed, nn.Embedding) and embed.num_embeddings % GROUP == 0:
            self.table, self.table_dtype = HalfEmbedding(embed.num_embeddings, embed.embedding_dim), table_dtype
            model.model.embed_tokens = self.table        # on meta: the fp32 table is never allocated
            if cfg.tie_word_embeddings and isinstance(head, PackedLinear):
                head.weight, self.tied_head = None, head
        for target, parts in found.items():
            linear = linears[target]
            dtypes = {dtype for _, dtype in parts}
            spans = [(0, linear.out_features) if rows is None else rows for rows, _ in parts]
            if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES or linear.out_features % GROUP or \
                    any(a % GROUP or b % GROUP for a, b in spans) or \
                    sum(b - a for a, b in spans) != linear.out_features:
                continue
            linear.weight = None          # on meta: never allocated in fp32
            self.layers[target] = _Layer(linear, _DTYPES[dtypes.pop()], len(parts))
        return self if self.layers or self.table is not None else None

    def take(self, target: str) -> bool:
        """Whether our weight `target` is held at 16 bits (then hand its checkpoint tensor to put())."""
        return target in self.layers or (target == _TABLE and self.table is not None)

    def put(self, target: str, rows: tuple[int, int] | None, tensor: torch.Tensor) -> None:
        """One checkpoint tensor of a 16-bit layer (a tensor-parallel rank's share of it): rows [a, b) of the layer
        (all of them when rows is None)."""
        if target == _TABLE and self.table is not None:
            self._put_table(tensor)
            return
        layer = self.layers[target]
        linear = layer.linear
        a, b = (0, linear.out_features) if rows is None else rows
        if tuple(tensor.shape) != (b - a, linear.in_features) or tensor.dtype != layer.dtype:
            raise ValueError(f"{target}[{a}:{b}]: checkpoint tensor {tuple(tensor.shape)} {tensor.dtype}, expected "
                             f"{(b - a, linear.in_features)} {layer.dtype}")
        if (a, b) in layer.filled:
            raise ValueError(f"{target}[{a}:{b}] appears twice in the checkpoint")
        if layer.packed is None:
            layer.packed = empty_w16(layer.dtype, linear.out_features, linear.in_features)
        layer.packed.qs[a // GROUP:b // GROUP].copy_(w16_rows(tensor))
        layer.filled.add((a, b))
        if len(layer.filled) == layer.parts:
            linear.use_packed(layer.packed)

    def _put_table(self, tensor: torch.Tensor) -> None:
        table = self.table
        if tuple(tensor.shape) != (table.num_embeddings, table.embedding_dim) or tensor.dtype != self.table_dtype:
            raise ValueError(f"{_TABLE}: checkpoint tensor {tuple(tensor.shape)} {tensor.dtype}, expected "
                             f"{(table.num_embeddings, table.embedding_dim)} {self.table_dtype}")
        if table.packed is not None:
            raise ValueError(f"{_TABLE} appears twice in the checkpoint")
        table.packed = pack_w16(tensor)
        if self.tied_head is not None:       # the logits multiply by the same 16-bit rows
            self.tied_head.use_packed(table.packed)

    def check_done(self) -> str:
        """After the last shard: every 16-bit layer whole; returns the log line (weights in memory)."""
        missing = [t for t, layer in self.layers.items() if len(layer.filled) != layer.parts] + \
            ([_TABLE] if self.table is not None and self.table.packed is None else [])
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}")
        kinds: dict[str, int] = {}
        for layer in self.layers.values():
            name = KIND_NAMES[layer.packed.kind]
            kinds[name] = kinds.get(name, 0) + 1
        held = sum(layer.packed.nbytes for layer in self.layers.values())
        shown = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        table = "" if self.table is None else \
            (f"; the embedding table {self.table.packed.nbytes / 2**20:.2f} MiB" +
             (", shared by the tied lm_head" if self.tied_head is not None else ""))
        return (f"16-bit weights kept at their width: {len(self.layers)} linears ({shown}): {held / 2**20:.2f} MiB "
                f"in memory, {2 * held / 2**20:.2f} MiB as fp32 (widened exactly in the C kernels){table}")
