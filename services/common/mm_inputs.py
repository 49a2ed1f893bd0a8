"""One image of a prompt as it travels gateway -> scheduler -> worker (steploop.v1.MultiModalFeature).

The gateway's processor turns an image into pixel patches and expands its placeholder in the prompt to `length`
tokens starting at `offset`. The scheduler reads only hash / offset / length (prefix-cache keys, encoder budget and
cache); the worker encodes pixel_values once per hash and writes the embeddings over the placeholder rows.
No torch here: pixels are float32 bytes with their shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from steploop.common.pb.steploop.v1 import engine_pb2


@dataclass(frozen=True, eq=False)
class MultiModalFeature:
    hash: str                            # content hash of the decoded image (hex)
    offset: int                          # first placeholder token's index in the prompt
    length: int                          # placeholder tokens (= embeddings the encoder yields)
    grid_thw: tuple[int, int, int]       # patches along time, height, width
    pixel_shape: tuple[int, ...]         # e.g. (num_patches, patch_dim)
    pixel_values: bytes                  # float32 little-endian, row-major

    @property
    def end(self) -> int:
        return self.offset + self.length

    def to_pb(self) -> engine_pb2.MultiModalFeature:
        return engine_pb2.MultiModalFeature(hash=self.hash, offset=self.offset, length=self.length,
                                            grid_thw=list(self.grid_thw), pixel_shape=list(self.pixel_shape),
                                            pixel_values=self.pixel_values)

    @classmethod
    def from_pb(cls, pb: engine_pb2.MultiModalFeature) -> MultiModalFeature:
        return cls(hash=pb.hash, offset=pb.offset, length=pb.length, grid_thw=tuple(pb.grid_thw),
                   pixel_shape=tuple(pb.pixel_shape), pixel_values=pb.pixel_values)


def check_features(features: list[MultiModalFeature], num_prompt_tokens: int) -> None:
    """Placeholder ranges lie inside the prompt, in order, without overlap; ValueError says which does not."""
    end = 0
    for i, f in enumerate(features):
        if f.length <= 0 or f.offset < end or f.end > num_prompt_tokens:
            raise ValueError(f"image {i}: placeholder range [{f.offset}, {f.end}) is empty, overlaps the previous "
                             f"image or leaves the {num_prompt_tokens}-token prompt")
        if len(f.grid_thw) != 3:
            raise ValueError(f"image {i}: grid_thw must have 3 entries, got {list(f.grid_thw)}")
        expected = 4 * int(f.pixel_shape[0]) if f.pixel_shape else -1
        if f.pixel_shape and len(f.pixel_values) != expected * _prod(f.pixel_shape[1:]):
            raise ValueError(f"image {i}: {len(f.pixel_values)} pixel bytes do not fill shape {list(f.pixel_shape)}")
        end = f.end


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out
