"""The one way every steploop process runs its asyncio main: on uvloop where it is installed (a base dependency
everywhere but Windows), else on asyncio's default loop. uvloop's C event loop spends less CPU per socket event,
and on a machine whose cores the model's forward keeps busy that CPU comes out of the forward's time."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
