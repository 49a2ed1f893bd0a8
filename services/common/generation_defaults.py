"""The model's sampling defaults (steploop.v1.GenerationDefaults): what generation_config.json recommends for the
sampling fields a request does not set, as vLLM's `--generation-config auto` takes them.

The worker reads them (gpu_worker/generation_config.py) and says them in WorkerHello; the scheduler passes them on in
ModelInfo; the gateway uses them as the defaults of its request parsers. A field left None is the API's own default.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from steploop.common.pb.steploop.v1 import engine_pb2

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None        # generation_config's max_new_tokens: caps every request (as vLLM)

    def get(self, name: str, fallback: Any) -> Any:
        """The model's default for `name`, else the API's `fallback`."""
        value = getattr(self, name)
        return fallback if value is None else value

    def overridden(self) -> dict[str, Any]:
        """The fields the model sets (for the start-up log line)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def to_pb(self) -> engine_pb2.GenerationDefaults:
        return engine_pb2.GenerationDefaults(**self.overridden())

    @classmethod
    def from_pb(cls, pb: engine_pb2.GenerationDefaults) -> GenerationDefaults:
        # float32 on the wire: round to 6 significant digits so 0.7 stays 0.7 (the file's value), not 0.699999988
        values = {k: getattr(pb, k) for k in FIELDS if pb.HasField(k)}
        return cls(**{k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in values.items()})


NO_DEFAULTS = GenerationDefaults()
