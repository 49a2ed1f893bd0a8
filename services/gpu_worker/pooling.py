"""The pooling runner (`--runner pooling`): one vector per prompt from the final (normed) hidden states.

The pooling config comes from the model folder as vLLM reads it: sentence-transformers' modules.json names a
Pooling module whose config.json sets one `pooling_mode_*` (lasttoken -> LAST, mean_tokens -> MEAN,
cls_token -> CLS), and a Normalize module means L2-normalized. Without modules.json: LAST, normalized (vLLM's
default for a decoder LM). Modules that change the math and are not implemented here (Dense, LayerNorm, ...)
are refused, never ignored. config.json's `matryoshka_dimensions` / `is_matryoshka` allow `dimensions`.

Per step, for a pooling request whose chunk covers positions c .. c + n - 1 of its P prompt tokens:
    LAST   the row of position P - 1, in the chunk that reaches P (a prefix-cache hit is fine: that token is
           always computed)
    MEAN   every row, summed in fp32 over the chunks; / P at the end (the scheduler gives it no prefix hits)
    CLS    the row of position 0 (no prefix hits either), kept until the chunk that reaches P
then truncated to `dimensions` (Matryoshka) and normalized, as vLLM does.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

import torch

from steploop.common.pooling_params import PoolingConfig
from steploop.common.step_contract import StepPlan
from steploop.gpu_worker.input_batch import InputBatch, RequestState

_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_KNOWN_MODULES = {"sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
                  "sentence_transformers.models.Normalize"}


def _read_json(path: pathlib.Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


def has_sentence_transformers_config(model_dir: pathlib.Path) -> bool:
    """`--runner auto` picks pooling for a folder saved by sentence-transformers (it has modules.json)."""
    return (pathlib.Path(model_dir) / "modules.json").is_file()


def load_pooling_config(model_dir: pathlib.Path, hidden_size: int) -> PoolingConfig:
    """The folder's pooling config (see the module docstring); ValueError names what cannot be served."""
    model_dir = pathlib.Path(model_dir)
    hf = _read_json(model_dir / "config.json") or {}
    dims = tuple(int(d) for d in hf.get("matryoshka_dimensions") or ())
    matryoshka = bool(dims) or bool(hf.get("is_matryoshka", False))
    modules = _read_json(model_dir / "modules.json")
    if modules is None:
        return PoolingConfig("LAST", True, hidden_size, matryoshka, dims)
    unknown = [m.get("type") for m in modules if m.get("type") not in _KNOWN_MODULES]
    if unknown:
        raise ValueError(f"{model_dir}/modules.json has modules steploop does not implement: {unknown}; serving "
                         "without them would give other vectors than sentence-transformers")
    normalize = any(m["type"] == "sentence_transformers.models.Normalize" for m in modules)
    pooling = next((m for m in modules if m["type"] == "sentence_transformers.models.Pooling"), None)
    if pooling is None:
        return PoolingConfig("LAST", True, hidden_size, matryoshka, dims)
    cfg_path = model_dir / pooling.get("path", "") / "config.json"
    return PoolingConfig(_pooling_type(_read_json(cfg_path) or {}, cfg_path), normalize, hidden_size, matryoshka, dims)


def _pooling_type(cfg: dict, path: pathlib.Path) -> str:
    chosen = [mode for mode in (*_MODES, *_OTHER_MODES) if cfg.get(mode) is True]
    if len(chosen) != 1 or chosen[0] not in _MODES:
        raise ValueError(f"{path}: exactly one of {', '.join(_MODES)} must be true for steploop to pool "
                         f"(found {chosen or 'none'})")
    if cfg.get("include_prompt", True) is False:
        raise ValueError(f"{path}: include_prompt false (pooling without the instruction prefix) is not supported")
    return _MODES[chosen[0]]


@dataclass
class PoolingRows:
    """The hidden-state rows one step needs, and which requests finish (get their vector) this step."""
    rows: list[int] = field(default_factory=list)                # [R] flat token rows of the step's batch
    spans: list[tuple[int, int]] = field(default_factory=list)   # (handle, rows it owns) in row order
    finishing: list[int] = field(default_factory=list)           # handles whose whole prompt is computed


class Pooler:
    def __init__(self, config: PoolingConfig) -> None:
        self.config = config

    def plan_rows(self, batch: InputBatch, plan: StepPlan) -> PoolingRows:
        """Call before the batch's counters advance for the step."""
        out, flat, kind = PoolingRows(), 0, self.config.pooling_type
        for handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            state = batch[handle]
            c, total = state.num_computed_tokens, state.num_prompt_tokens
            if state.pooling is None:
                raise ValueError(f"handle {handle} is a generation request; this worker runs --runner pooling")
            if kind != "LAST" and c > 0 and state.pooled_sum is None:
                raise ValueError(f"handle {handle}: {kind} pooling needs every position, but it starts at {c}")
            first, count = {"LAST": (n - 1, int(c + n == total)), "MEAN": (0, n), "CLS": (0, int(c == 0))}[kind]
            out.rows.extend(range(flat + first, flat + first + count))
            out.spans.append((handle, count))
            if c + n == total:
                out.finishing.append(handle)
            flat += n
        return out

    def pool(self, batch: InputBatch, rows: PoolingRows, hidden: torch.Tensor) -> dict[int, list[float]]:
        """hidden [R, hidden] of rows.rows -> handle -> vector, for the requests finishing this step."""
        hidden, pos = hidden.float(), 0
        for handle, count in rows.spans:
            if count:
                state = batch[handle]
                part = hidden[pos:pos + count].sum(dim=0)
                state.pooled_sum = part if state.pooled_sum is None else state.pooled_sum + part
                pos += count
        return {handle: self._finish(batch[handle]) for handle in rows.finishing}

    def _finish(self, state: RequestState) -> list[float]:
        vector = state.pooled_sum
        if self.config.pooling_type == "MEAN":
            vector = vector / state.num_prompt_tokens
        if state.pooling.dimensions:
            vector = vector[:state.pooling.dimensions]
        if self.config.normalize:
            vector = torch.nn.functional.normalize(vector, p=2.0, dim=-1)
        return vector.tolist()
