"""A PEFT LoRA adapter folder, read and checked without torch (the scheduler checks adapters when they are
registered; the worker checks again before it loads the tensors).

    adapter_config.json          r, lora_alpha, use_rslora, target_modules, ...
    adapter_model.safetensors    base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight
                                 A [r, in_features], B [out_features, r]

`read_adapter(path, shapes, max_rank)` returns an AdapterSpec or raises LoraAdapterError with a message that
names the problem: a missing folder or file, a malformed config, a feature we do not serve (DoRA, biases,
modules_to_save, per-module rank patterns), a rank above --max-lora-rank, a target other than the seven Llama
projections, or weights whose shapes do not fit the base model. The safetensors header is JSON (8-byte length
first), so shapes are known without reading the weights.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import struct
from dataclasses import dataclass

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# The projections an adapter may target, PEFT's names, in the order the worker stacks them.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraAdapterError(ValueError):
    """An adapter that cannot be served; the message says why (rendered as a 400 / 404 by the gateway)."""

    def __init__(self, message: str, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found       # the folder (or a file in it) does not exist


@dataclass(frozen=True)
class LoraModelShapes:
    """What an adapter must fit: the base model's layer count and each target's (in_features, out_features)."""

    num_layers: int
    targets: dict[str, tuple[int, int]]   # PEFT target name -> (in_features, out_features)

    @classmethod
    def for_llama(cls, num_layers: int, hidden: int, q_size: int, kv_size: int, intermediate: int) -> LoraModelShapes:
        return cls(num_layers, {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
                                "o_proj": (q_size, hidden), "gate_proj": (hidden, intermediate),
                                "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)})


@dataclass(frozen=True)
class AdapterSpec:
    path: str
    rank: int
    scaling: float                       # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    targets: tuple[str, ...]             # the TARGETS it has weights for, in TARGETS order
    tensor_names: dict[tuple[int, str, str], str]   # (layer, target, "A"|"B") -> name in the safetensors file


def read_adapter(path: str, shapes: LoraModelShapes | None, max_rank: int) -> AdapterSpec:
    """Check the folder (shapes None: everything but the fit to the base model, which needs the worker's shapes)."""
    folder = pathlib.Path(path).expanduser()
    if not folder.is_dir():
        raise LoraAdapterError(f"LoRA adapter folder {path!r} does not exist", not_found=True)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise LoraAdapterError(f"LoRA adapter folder {path!r} has no {name} (a PEFT adapter folder has "
                                   f"{CONFIG_FILE} and {WEIGHTS_FILE})", not_found=True)
    config = _read_config(folder / CONFIG_FILE)
    rank, scaling = _rank_and_scaling(config, path, max_rank)
    header = _safetensors_header(folder / WEIGHTS_FILE)
    names = _tensor_names(header, path)
    for (layer, target, kind), name in names.items():
        _check_shape(header[name]["shape"], layer, target, kind, rank, shapes, path)
    targets = tuple(t for t in TARGETS if any(key[1] == t for key in names))
    if not targets:
        raise LoraAdapterError(f"LoRA adapter {path!r} has no lora_A/lora_B weights for any of {', '.join(TARGETS)}")
    return AdapterSpec(str(folder), rank, scaling, targets, names)


def _read_config(file: pathlib.Path) -> dict:
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraAdapterError(f"malformed {file}: {exc}") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(f"malformed {file}: expected a JSON object, got {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{file}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    refusals = {"use_dora": "DoRA adapters", "modules_to_save": "modules_to_save (fully trained extra modules)",
                "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
                "fan_in_fan_out": "fan_in_fan_out weights"}
    for key, what in refusals.items():
        if config.get(key):
            raise LoraAdapterError(f"{file}: {what} are not supported ({key} = {config[key]!r})")
    if config.get("bias", "none") != "none":
        raise LoraAdapterError(f"{file}: LoRA biases are not supported (bias = {config['bias']!r}; use 'none')")
    return config


def _rank_and_scaling(config: dict, path: str, max_rank: int) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraAdapterError(f"malformed {CONFIG_FILE} in {path!r}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraAdapterError(f"malformed {CONFIG_FILE} in {path!r}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:
        raise LoraAdapterError(f"LoRA rank {rank} of {path!r} is greater than max_lora_rank {max_rank}; "
                               f"start the server with --max-lora-rank {rank} or more")
    return rank, float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _safetensors_header(file: pathlib.Path) -> dict:
    try:
        with file.open("rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            if size > 100 * 2**20:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError) as exc:
        raise LoraAdapterError(f"{file} is not a safetensors file: {exc}") from None
    header.pop("__metadata__", None)
    return header


def _tensor_names(header: dict, path: str) -> dict[tuple[int, str, str], str]:
    names: dict[tuple[int, str, str], str] = {}
    for name in header:
        match = _KEY.match(name)
        if match is None:
            raise LoraAdapterError(f"LoRA adapter {path!r} has weight {name!r}, which is not a lora_A/lora_B weight "
                                   f"of a decoder layer's {', '.join(TARGETS)} (embeddings and lm_head are not "
                                   "supported targets)")
        layer, target, kind = int(match.group(1)), match.group(2), match.group(3)
        if target not in TARGETS:
            raise LoraAdapterError(f"LoRA adapter {path!r} targets {target!r}, which is not supported; supported "
                                   f"targets: {', '.join(TARGETS)}")
        names[(layer, target, kind)] = name
    for layer, target, kind in names:
        if (layer, target, "B" if kind == "A" else "A") not in names:
            raise LoraAdapterError(f"LoRA adapter {path!r}: layer {layer} {target} has lora_{kind} but not its pair")
    return names


def _check_shape(shape: list[int], layer: int, target: str, kind: str, rank: int, shapes: LoraModelShapes | None,
                 path: str) -> None:
    where = f"LoRA adapter {path!r}: layer {layer} {target}.lora_{kind}"
    if len(shape) != 2 or (shape[0] if kind == "A" else shape[1]) != rank:
        raise LoraAdapterError(f"{where} has shape {shape}, not a rank-{rank} factor (r in {CONFIG_FILE})")
    if shapes is None:
        return
    if layer >= shapes.num_layers:
        raise LoraAdapterError(f"{where}: the base model has {shapes.num_layers} layers; this adapter was trained "
                               "for another base model")
    in_features, out_features = shapes.targets[target]
    want = [rank, in_features] if kind == "A" else [out_features, rank]
    if list(shape) != want:
        raise LoraAdapterError(f"{where} has shape {list(shape)} but the base model needs {want}; this adapter "
                               "was trained for another base model")
