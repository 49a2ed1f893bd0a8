"""Integer arithmetic shared by the services (block counts, chunk counts)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for integers: how many blocks of b hold a items."""
    return -(-a // b)
