"""transformers 4 and 5 config forms, read as one: the rotary fields in their transformers 4 shape.

transformers 4 keeps `rope_theta` (and Gemma 3's `rope_local_base_freq`, Phi's `partial_rotary_factor`) at the top
level and the scaling in `rope_scaling`; transformers 5 moves them all into `rope_parameters`:

    v4: {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, ...}}
    v5: {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, ...}}
    v5, per layer type (Gemma 3): {"rope_parameters": {"full_attention": {...}, "sliding_attention": {...}}}

Either version of transformers may meet either form of config.json (transformers 4 keeps an unknown
`rope_parameters` as a plain attribute, beside its own default `rope_theta`), so `rope_parameters`, when present,
wins. The families' readers (families.py) then see only the v4 fields.
"""

from __future__ import annotations

from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")
_LIFTED = ("rope_theta", "partial_rotary_factor")       # top-level fields in v4, inside rope_parameters in v5


def to_v4_rope(values: dict[str, Any]) -> dict[str, Any]:
    """A copy of a config dict with `rope_parameters` (if any) turned into rope_theta / rope_scaling / ..."""
    params = values.get("rope_parameters")
    out = {k: v for k, v in values.items() if k != "rope_parameters"}
    if not params:
        return out
    if not isinstance(params, dict):
        raise ValueError(f"config.json rope_parameters={params!r} is not a mapping")  # noqa: TRY004 - exit 2
    if set(params) <= set(LAYER_TYPES) and all(isinstance(v, dict) for v in params.values()):
        full = params.get("full_attention") or params.get("sliding_attention")
        sliding = params.get("sliding_attention")
        if sliding is not None and sliding != full:
            out["rope_local_base_freq"] = _local_theta(sliding)
        params = full
    scaling = {k: v for k, v in params.items() if k not in _LIFTED}
    out["rope_theta"] = params.get("rope_theta", out.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in params:
        out["partial_rotary_factor"] = params["partial_rotary_factor"]
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    resolved = None if kind == "default" and set(scaling) <= {"rope_type", "type"} else scaling
    if values.get("rope_scaling") not in (None, resolved):
        raise ValueError(f"config.json sets both rope_scaling={values['rope_scaling']!r} and "
                         f"rope_parameters={values['rope_parameters']!r}, which disagree: keep one")
    out["rope_scaling"] = resolved
    return out


def _local_theta(sliding: dict[str, Any]) -> float:
    """The windowed layers' base: the reader models them as default rope with their own theta (Gemma 3)."""
    kind = sliding.get("rope_type") or sliding.get("type") or "default"
    extra = set(sliding) - {"rope_type", "type", "rope_theta"}
    if kind != "default" or extra:
        raise ValueError(f"config.json rope_parameters.sliding_attention={sliding!r}: only default rope "
                         "(a rope_theta of their own) is supported for the sliding-window layers")
    return float(sliding.get("rope_theta", 10000.0))
