"""Responses kept in gateway memory for `previous_response_id` and GET / DELETE /v1/responses/{id}: every response
made with `store` true (the default, as OpenAI's), at most MAX_STORED (the oldest evicted first), each for TTL_S
seconds after it was created. Nothing is written to disk and each gateway process has its own store (behind several
gateways, route a conversation to one of them, or resend the history).

An id that is not there is a 404 that says why: made with `store: false`, expired, evicted, deleted, or never made
by this gateway. The reasons are remembered for the last FORGOTTEN_KEPT ids (ids only: small), so the store stays
bounded."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from steploop.gateway.errors import APIError

MAX_STORED = 1024
TTL_S = 3600.0
FORGOTTEN_KEPT = 16 * MAX_STORED


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]                 # the Response object as returned
    messages: tuple[dict[str, Any], ...]     # the conversation through this response's output (chat messages)
    created: float


class ResponseStore:
    def __init__(self, max_stored: int = MAX_STORED, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic, forgotten_kept: int = FORGOTTEN_KEPT) -> None:
        self.max_stored, self.ttl_s, self.clock, self.forgotten_kept = max_stored, ttl_s, clock, forgotten_kept
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._gone: OrderedDict[str, str] = OrderedDict()    # id -> why it is not in _items

    def put(self, response: dict[str, Any], messages: tuple[dict[str, Any], ...]) -> None:
        self._expire()
        self._items[response["id"]] = Stored(response, messages, self.clock())
        while len(self._items) > self.max_stored:
            evicted, _ = self._items.popitem(last=False)
            self._forget(evicted, f"was evicted: this gateway keeps the {self.max_stored} most recent responses")

    def not_stored(self, response_id: str) -> None:
        """A response made with `store: false`: remembered only to say so when it is asked for."""
        self._forget(response_id, "was created with 'store': false, so it was not kept (store defaults to true)")

    def get(self, response_id: str, param: str | None = None) -> Stored:
        self._expire()
        stored = self._items.get(response_id)
        if stored is None:
            raise self._not_found(response_id, param)
        return stored

    def delete(self, response_id: str) -> None:
        self._expire()
        if self._items.pop(response_id, None) is None:
            raise self._not_found(response_id)
        self._forget(response_id, "was deleted")

    def _expire(self) -> None:
        deadline = self.clock() - self.ttl_s
        while self._items and next(iter(self._items.values())).created < deadline:
            expired, _ = self._items.popitem(last=False)
            self._forget(expired, f"has expired: responses are kept {self.ttl_s:g} s after they are created")

    def _forget(self, response_id: str, why: str) -> None:
        self._gone[response_id] = why
        self._gone.move_to_end(response_id)
        while len(self._gone) > self.forgotten_kept:
            self._gone.popitem(last=False)

    def _not_found(self, response_id: str, param: str | None = None) -> APIError:
        why = self._gone.get(response_id, "was never created by this gateway (or was forgotten long ago; each "
                                          "gateway process has its own store)")
        return APIError(404, f"Response with id '{response_id}' not found: it {why}.", param=param,
                        code="response_not_found")
