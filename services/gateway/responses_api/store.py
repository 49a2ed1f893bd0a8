"""Responses created with `store: true`, kept in gateway memory for `previous_response_id` and GET / DELETE
/v1/responses/{id}: at most MAX_STORED (the oldest evicted first), each for TTL_S seconds after it was created.
Nothing is written to disk and each gateway process has its own store (behind several gateways, route a
conversation to one of them, or resend the history). An evicted or unknown id is a 404, as OpenAI's."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from steploop.gateway.errors import APIError

MAX_STORED = 1024
TTL_S = 3600.0


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]                 # the Response object as returned
    messages: tuple[dict[str, Any], ...]     # the conversation through this response's output (chat messages)
    created: float


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param, code="response_not_found")


class ResponseStore:
    def __init__(self, max_stored: int = MAX_STORED, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_stored, self.ttl_s, self.clock = max_stored, ttl_s, clock
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response: dict[str, Any], messages: tuple[dict[str, Any], ...]) -> None:
        self._expire()
        self._items[response["id"]] = Stored(response, messages, self.clock())
        while len(self._items) > self.max_stored:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> Stored:
        self._expire()
        stored = self._items.get(response_id)
        if stored is None:
            raise not_found(response_id, param)
        return stored

    def delete(self, response_id: str) -> None:
        self._expire()
        if self._items.pop(response_id, None) is None:
            raise not_found(response_id)

    def _expire(self) -> None:
        deadline = self.clock() - self.ttl_s
        while self._items and next(iter(self._items.values())).created < deadline:
            self._items.popitem(last=False)
