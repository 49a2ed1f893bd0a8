"""QuantLoader: the loader's side for a quantized checkpoint (model/loader.py calls it).

    quant = QuantLoader.prepare(model, cfg, files, device, use_c, loader._target)
        # on meta: reads the headers, checks every quantized tensor's shape, swaps linears for QuantLinear
    ... model.to_empty(); each tensor of each shard: quant.put(name, tensor) if quant.take(name), else dense ...
    quant.check_done()

prepare() refuses (ValueError) before any weight is read: a quantized tensor outside the decoder layers' linears
and experts, a fused layer (q/k/v, gate/up) only partly quantized, a mixture-of-experts layer whose experts are
quantized only in part, quantized experts on a tensor-parallel rank, a missing or misshapen tensor, a group size
that does not divide a layer. A mixture-of-experts layer's experts (and Qwen2-MoE's shared expert) become one
QuantLinear per expert and projection (gate and up fused), handed to the SparseMoE (moe.py: use_quantized). A layer
is packed as soon as its last tensor arrives, so at most the layers that straddle a shard boundary are held
unpacked.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Callable

import torch
from safetensors import safe_open
from torch import nn

from steploop.gpu_worker.model.model_config import ModelConfig
from steploop.gpu_worker.model.quant.config import QuantScheme
from steploop.gpu_worker.model.quant.formats import TENSORS, Shapes, read_linear, tensor_kind
from steploop.gpu_worker.model.quant.linear import QuantLinear
from steploop.gpu_worker.model.quant.shards import shard_weight

_MARKER = {"gptq": "qweight", "awq": "qweight", "ct_int": "weight_packed", "ct_fp8": "weight_scale"}
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp)\.(w13|w2|shared_w13|shared_w2)$")   # moe.expert_target's names


def _headers(files: list[pathlib.Path]) -> dict[str, dict[str, tuple[int, ...]]]:
    """checkpoint module -> {tensor suffix: shape}, from the safetensors headers only."""
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                module, _, suffix = name.rpartition(".")
                modules.setdefault(module, {})[suffix] = tuple(f.get_slice(name).get_shape())
    return modules


class QuantLoader:
    def __init__(self, scheme: QuantScheme, device: torch.device, use_c: bool):
        self.scheme, self.device, self.use_c = scheme, device, use_c
        self.owner: dict[str, QuantLinear] = {}                   # checkpoint module -> the layer it fills
        self.claimed: dict[str, tuple[str, ...]] = {}             # checkpoint module -> its quantized tensor suffixes
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.layers: dict[str, QuantLinear] = {}
        self.stored: dict[str, tuple[int, int]] = {}              # checkpoint module -> its whole [N, K]
        self.sharder = None                                       # a tensor-parallel rank's CheckpointSharder

    @classmethod
    def prepare(cls, model: nn.Module, cfg: ModelConfig, files: list[pathlib.Path], device: torch.device,
                use_c: bool, target_of: Callable, sharder=None) -> QuantLoader:
        """target_of: the loader's checkpoint-name -> (our parameter, expert, row slice) map (loader._target).
        sharder: on a tensor-parallel rank (model built at the rank's sizes), each layer is read whole, checked
        against the whole checkpoint's shapes and cut to the rank's share at its stored width (quant/shards.py)."""
        self = cls(cfg.quant, device, use_c)
        self.sharder = sharder
        kind = tensor_kind(cfg.quant)
        required, optional = TENSORS[kind]
        modules = _headers(files)
        parts: dict[str, list[tuple[int, str, int]]] = {}          # our layer -> [(row start, checkpoint module, N)]
        experts: dict[tuple[str, str], dict[int | None, list[tuple[int, str, int]]]] = {}   # (moe, w13..) -> expert
        for module, shapes in modules.items():
            if _MARKER[kind] not in shapes:
                continue
            target, expert, rows = target_of(module + ".weight", cfg)
            ours = target.removesuffix(".weight")
            moe = _EXPERTS.match(ours)
            if moe is not None:
                if sharder is not None:
                    raise ValueError(f"{module} is a quantized expert: quantized mixture-of-experts checkpoints run "
                                     "with -tp 1 for now")
                out_features, in_features = _expert_shape(model.get_submodule(moe.group(1)).spec, moe.group(2),
                                                          cfg.hidden_size)
                n = out_features if rows is None else rows[1] - rows[0]
                self.stored[module] = (n, in_features)
            elif expert is not None or not ours.startswith("model.layers.") or not ours.endswith(_LINEARS):
                raise ValueError(f"{module} is quantized ({cfg.quant.describe()}): steploop runs quantized weights "
                                 "only in the decoder layers' attention and MLP linears")
            else:
                linear = model.get_submodule(ours)
                n = linear.out_features if rows is None else rows[1] - rows[0]
                self.stored[module] = (n, linear.in_features) if sharder is None else _whole_shape(sharder, module)
            claimed = {s: shape for s, shape in shapes.items() if s in required + optional}
            Shapes(cfg.quant, module, *self.stored[module]).check(claimed)
            self.claimed[module] = tuple(claimed)
            found = (0 if rows is None else rows[0], module, n)
            if moe is not None:
                experts.setdefault(moe.groups(), {}).setdefault(expert, []).append(found)
            else:
                parts.setdefault(ours, []).append(found)
        if not parts and not experts:
            raise ValueError(f"config.json declares {cfg.quant.describe()} but no tensor of the checkpoint is "
                             f"quantized that way (no *.{_MARKER[kind]})")
        for ours, found in parts.items():
            self._install(model, ours, sorted(found), modules)
        for (moe, name), found in experts.items():
            self._install_experts(model.get_submodule(moe), moe, name, found, cfg.hidden_size)
        return self

    def _install_experts(self, sparse: nn.Module, moe: str, name: str,
                         found: dict[int | None, list[tuple[int, str, int]]], hidden: int) -> None:
        """One QuantLinear per held expert (or the one shared expert) of `name` (w13: gate and up rows)."""
        out_features, in_features = _expert_shape(sparse.spec, name, hidden)
        wanted = [None] if name.startswith("shared_") else list(range(sparse.spec.held_experts))
        if sorted(found, key=str) != sorted(wanted, key=str):
            raise ValueError(f"{moe}: experts {sorted(e for e in found if e is not None)} of its {name} are quantized, "
                             f"not all {len(wanted)}; steploop needs all or none")
        layers = []
        for expert in wanted:
            rows = sorted(found[expert])
            if sum(n for _, _, n in rows) != out_features:
                raise ValueError(f"{moe}.{name}: expert {expert}'s parts are quantized only in part "
                                 f"({[m for _, m, _ in rows]} of {out_features} rows); steploop needs all or none")
            layer = QuantLinear(in_features, out_features, False, [m for _, m, _ in rows])
            layers.append(layer)
            self.layers[f"{moe}.{name}" + ("" if expert is None else f"[{expert}]")] = layer
            for _, module, _ in rows:
                self.owner[module] = layer
        sparse.use_quantized(name, layers)

    def _install(self, model: nn.Module, ours: str, found: list[tuple[int, str, int]], modules: dict) -> None:
        linear = model.get_submodule(ours)
        if sum(n for _, _, n in found) != linear.out_features:
            dense = sorted(m for m, shapes in modules.items() if "weight" in shapes and m not in self.claimed
                           and m.startswith(ours.rsplit(".", 1)[0] + "."))
            raise ValueError(f"{ours}: its checkpoint parts are quantized only in part ({[m for _, m, _ in found]} "
                             f"quantized, {dense} not); steploop needs all or none")
        layer = QuantLinear(linear.in_features, linear.out_features, linear.bias is not None,
                            [m for _, m, _ in found])
        parent, _, child = ours.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        self.layers[ours] = layer
        for _, module, _ in found:
            self.owner[module] = layer

    def take(self, name: str) -> bool:
        """Whether the tensor `name` is one of the quantized tensors (then hand it over with put())."""
        module, _, suffix = name.rpartition(".")
        return suffix in self.claimed.get(module, ())

    def put(self, name: str, tensor: torch.Tensor) -> None:
        module, _, suffix = name.rpartition(".")
        got = self.pending.setdefault(module, {})
        got[suffix] = tensor
        if len(got) < len(self.claimed[module]):
            return
        layer = self.owner[module]
        weight = read_linear(self.scheme, module, self.pending.pop(module), *self.stored[module])
        layer.loaded[module] = weight if self.sharder is None else \
            shard_weight(weight, self.sharder.split(module + ".weight"), module)
        if len(layer.loaded) == len(layer.parts):
            layer.finish(self.device, self.use_c)

    def check_done(self) -> str:
        """After the last shard: every quantized layer built; returns the log line (weights in memory)."""
        unfinished = [name for name, layer in self.layers.items() if not layer.segments]
        if unfinished or self.pending:
            raise ValueError(f"checkpoint is missing quantized tensors of {sorted(self.pending) or unfinished[:4]}")
        return memory_summary(self.scheme, self.layers)


def _expert_shape(spec, name: str, hidden: int) -> tuple[int, int]:
    """(out, in) of one expert's w13 / w2 or the shared expert's (moe.py's layout)."""
    inter = spec.shared_intermediate_size if name.startswith("shared_") else spec.intermediate_size
    return (2 * inter, hidden) if name.endswith("w13") else (hidden, inter)


def _whole_shape(sharder, module: str) -> tuple[int, int]:
    try:
        return sharder.full_shape(module + ".weight")
    except KeyError:
        raise ValueError(f"{module}: a quantized checkpoint layer steploop does not split across tensor-parallel "
                         "ranks (only q/k/v/o_proj and gate/up/down_proj are); run -tp 1") from None


def memory_summary(scheme: QuantScheme, layers: dict[str, QuantLinear]) -> str:
    kinds: dict[str, int] = {}
    for layer in layers.values():
        for segment in layer.segments:
            kinds[segment.describe()] = kinds.get(segment.describe(), 0) + 1
    held = sum(layer.nbytes for layer in layers.values())
    fp32 = sum(layer.in_features * layer.out_features * 4 for layer in layers.values())
    shown = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    return (f"quantized weights ({scheme.describe()}): {len(layers)} linears ({shown}): {held / 2**20:.2f} MiB in "
            f"memory, {fp32 / 2**20:.2f} MiB as fp32")
