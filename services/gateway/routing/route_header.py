"""The router's decisions, visible on the HTTP response that carried them:

    x-steploop-replica: 10.0.0.7:50051          the scheduler replica each choice went to (comma-separated for n > 1)
    x-steploop-prefix-match-tokens: 448          the prompt tokens that replica was known to cache
    x-steploop-route-source: events              events (its KV events said so), guess (where similar prompts
                                                 went), or load (no useful match: the least loaded replica)

A middleware gives each HTTP request a list (a ContextVar holding it, so tasks spawned for n > 1 choices append
to the same one); the router appends to it; the headers are added when the response is prepared, which for a
stream is after its first chunk, so after every choice was routed.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from aiohttp import web

REPLICA_HEADER = "x-steploop-replica"
MATCH_HEADER = "x-steploop-prefix-match-tokens"
SOURCE_HEADER = "x-steploop-route-source"


@dataclass(frozen=True)
class RouteNote:
    replica: str              # the replica's address
    matched_tokens: int       # prompt tokens found cached there (events) or expected there (guess)
    source: str               # "events", "guess" or "load"


_NOTES: contextvars.ContextVar[list[RouteNote] | None] = contextvars.ContextVar("steploop_route_notes", default=None)


def note(decision: RouteNote) -> None:
    """Record a routing decision on the HTTP request being served, if any (gRPC-only callers have none)."""
    notes = _NOTES.get()
    if notes is not None:
        notes.append(decision)


@web.middleware
async def middleware(request: web.Request, handler):
    _NOTES.set([])
    return await handler(request)


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    notes = _NOTES.get()
    if notes:
        response.headers[REPLICA_HEADER] = ",".join(n.replica for n in notes)
        response.headers[MATCH_HEADER] = ",".join(str(n.matched_tokens) for n in notes)
        response.headers[SOURCE_HEADER] = ",".join(n.source for n in notes)
