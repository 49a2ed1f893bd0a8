"""Request migration: a request whose scheduler replica dies, drains or breaks its stream mid-generation goes on
on another replica, and the client's stream goes on with no token lost, repeated or changed.

The gateway has every token it delivered: the new replica gets the prompt plus those tokens as
GenerateRequest.resume_output_token_ids, which it treats as outputs (max_tokens/min_tokens, penalties, stop ids,
the grammar and the seed's position count them: engine.proto) and streams only what comes after. The
text-level state of the request (detokenizer, held-back stop-string text, tool and reasoning parsers, logprobs,
usage) lives in generation.py above this layer and never notices: it sees one stream of chunks. Every choice of
`n > 1` is its own engine request, so each moves on its own; json_schema requests move too (the worker's
grammar replays the delivered tokens).

Reasons (the `reason` label of steploop:request_migrations_total):
- replica_unavailable: its stream broke (the process died, the link was cut, the server went away).
- replica_draining: its gRPC health stopped saying SERVING (SIGTERM's drain, or no worker attached) while
  another replica is up: its requests are moved at once instead of waiting out its --shutdown-timeout.

A request migrates at most `max_migrations` times (--max-migrations; 0: never); one with nowhere to go (no other
replica up) fails with the error it had, as without migration.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from steploop.common.engine_contract import EngineChunk, EngineRequest
from steploop.common.sampling_params import SamplingParams
from steploop.gateway import errors

logger = logging.getLogger(__name__)

DEFAULT_MAX_MIGRATIONS = 3
DRAINING_CODE = "replica_draining"   # the APIError code of a request taken off a replica that stopped serving
# APIError code -> migration reason. Anything else (a bad request, an engine error) is the request's own failure.
MIGRATABLE = {"engine_unavailable": "replica_unavailable", DRAINING_CODE: "replica_draining"}


def draining_error(address: str) -> errors.APIError:
    return errors.APIError(503, f"service unavailable: scheduler {address} stopped serving", type="server_error",
                           code=DRAINING_CODE, headers={"Retry-After": "1"})


@dataclass
class Placement:
    """Where one attempt of a request runs: the router fills it in as it picks a replica."""
    address: str = ""
    started: bool = False        # a chunk came from that replica


# route(request, avoid, placement) -> chunks: one try of the request (the router's), on a replica not in `avoid`
Route = Callable[[EngineRequest, frozenset[str], "Placement"], AsyncIterator[EngineChunk]]


class Migration:
    """The router's generate, with migration. One per router; counts migrations for /metrics."""

    def __init__(self, max_migrations: int = DEFAULT_MAX_MIGRATIONS) -> None:
        if max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0 (0: off), got {max_migrations}")
        self.max_migrations = max_migrations
        self.registry = CollectorRegistry(auto_describe=False)
        self.migrations = Counter("steploop:request_migrations", "Requests moved to another scheduler replica "
                                  "mid-generation, by reason", ["reason"], registry=self.registry)
        self.failures = Counter("steploop:request_migration_failures", "Requests that could not move (nowhere to "
                                "go, or --max-migrations reached) and failed, by reason", ["reason"],
                                registry=self.registry)
        for reason in MIGRATABLE.values():   # every series exists from the start, at 0
            self.migrations.labels(reason)
            self.failures.labels(reason)

    async def generate(self, route: Route, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """request.pooling set: an embedding request (one chunk: it never has delivered tokens to resume from)."""
        request_id = request.request_id
        delivered: list[int] = []            # every token yielded so far, whichever replica sampled it
        any_chunk, moves, avoid = False, 0, frozenset()
        while True:
            placement = Placement()
            attempt = request if not any_chunk else dataclasses.replace(
                request, sampling=resumed_params(request.sampling), resume_output_token_ids=list(delivered))
            stream = route(attempt, avoid, placement)
            try:
                async for chunk in stream:
                    any_chunk = True
                    delivered.extend(chunk.token_ids)
                    yield chunk
                return
            except errors.APIError as err:
                reason = MIGRATABLE.get(err.code)
                if reason is None or not placement.started:   # before its first chunk the router failed over
                    if reason is not None and moves:
                        self._failed(request_id, reason, placement, err, "no other replica could take it")
                    raise
                if moves >= self.max_migrations:
                    self._failed(request_id, reason, placement, err, f"--max-migrations ({self.max_migrations})")
                    raise
                moves += 1
                self.migrations.labels(reason).inc()
                logger.warning("request %s: scheduler %s failed after %d delivered tokens (%s: %s); migrating "
                               "(%d/%d)", request_id, placement.address, len(delivered), reason, err.message, moves,
                               self.max_migrations, extra={"request_id": request_id, "migration_reason": reason,
                                                           "replica": placement.address,
                                                           "delivered_tokens": len(delivered)})
                avoid = frozenset({placement.address})
            finally:
                await stream.aclose()

    def _failed(self, request_id: str, reason: str, placement: Placement, err: errors.APIError, why: str) -> None:
        self.failures.labels(reason).inc()
        logger.error("request %s: scheduler %s failed (%s: %s) and it cannot migrate: %s", request_id,
                     placement.address, reason, err.message, why,
                     extra={"request_id": request_id, "migration_reason": reason, "replica": placement.address})


def resumed_params(params: SamplingParams) -> SamplingParams:
    """The request as a resumed replica runs it: its prompt logprobs went out with the first chunk."""
    if params.prompt_logprobs < 0:
        return params
    return dataclasses.replace(params, prompt_logprobs=-1)
