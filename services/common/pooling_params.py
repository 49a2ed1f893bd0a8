"""Embeddings' two small contracts: PoolingParams (per request) and PoolingConfig (per pooling worker).

They mirror steploop.v1.PoolingParams / PoolingConfig (protos/steploop/v1/engine.proto) and convert at the edge.
The `dimensions` check lives here, once, in vLLM's words: the gateway runs it for a fast 400 and the scheduler
runs it again for gRPC callers.
"""

from __future__ import annotations

from dataclasses import dataclass

from steploop.common.pb.steploop.v1 import engine_pb2

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("generate", "pooling")


@dataclass(frozen=True)
class PoolingParams:
    dimensions: int | None = None        # None: the full hidden size; else keep the first N before normalizing

    def to_pb(self) -> engine_pb2.PoolingParams:
        return engine_pb2.PoolingParams(dimensions=self.dimensions or 0)

    @classmethod
    def from_pb(cls, pb: engine_pb2.PoolingParams) -> PoolingParams:
        return cls(dimensions=pb.dimensions or None)


@dataclass(frozen=True)
class PoolingConfig:
    pooling_type: str = "LAST"           # LAST: the last prompt token; MEAN: all of them; CLS: the first
    normalize: bool = True               # L2-normalize the (truncated) vector
    hidden_size: int = 0
    is_matryoshka: bool = False          # the model was trained for truncated vectors (`dimensions` allowed)
    matryoshka_dimensions: tuple[int, ...] = ()   # the sizes allowed; () = any in 1..hidden_size

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling type {self.pooling_type!r} is not one of {', '.join(POOLING_TYPES)}")

    @property
    def pools_every_position(self) -> bool:
        """MEAN needs every prompt position's hidden state and CLS the first one: such requests take no
        prefix-cache hits (a hit skips computing those positions). LAST always computes its last token."""
        return self.pooling_type != "LAST"

    def check_dimensions(self, dimensions: int | None, model_name: str) -> None:
        """Raises ValueError (vLLM's wording) when `dimensions` cannot be served by this model."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise ValueError(f'Model "{model_name}" does not support matryoshka representation, changing output '
                             "dimensions will lead to poor results.")
        if self.matryoshka_dimensions:
            if dimensions not in self.matryoshka_dimensions:
                raise ValueError(f'Model "{model_name}" only supports {list(self.matryoshka_dimensions)} '
                                 "matryoshka dimensions, use other output dimensions will lead to poor results.")
        elif not 1 <= dimensions <= self.hidden_size:
            raise ValueError(f"dimensions must be between 1 and the model's hidden size {self.hidden_size}, "
                             f"got {dimensions}")

    def to_pb(self) -> engine_pb2.PoolingConfig:
        return engine_pb2.PoolingConfig(pooling_type=self.pooling_type, normalize=self.normalize,
                                        hidden_size=self.hidden_size, is_matryoshka=self.is_matryoshka,
                                        matryoshka_dimensions=list(self.matryoshka_dimensions))

    @classmethod
    def from_pb(cls, pb: engine_pb2.PoolingConfig) -> PoolingConfig:
        return cls(pb.pooling_type or "LAST", pb.normalize, pb.hidden_size, pb.is_matryoshka,
                   tuple(pb.matryoshka_dimensions))


def unsupported_api_message(api: str) -> str:
    """vLLM's words for a request to a model whose runner does not serve that API ("Embeddings", "Chat
    Completions", ...)."""
    return f"The model does not support {api} API"
