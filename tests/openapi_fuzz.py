"""One schemathesis fuzz loop for every test that fuzzes the gateway from its own /openapi.json: generated requests
per operation, and a 5xx (unless the operation's own contract allows it), a timeout or a dropped connection is a
failure, recorded with the request that caused it."""

from __future__ import annotations

import time
from collections.abc import Callable


def fuzz_operation(op, base_url: str, failures: list[str], deadline: float, *, examples: int,
                   headers: dict | None = None, timeout: float = 60,
                   allowed_5xx: Callable[[object, int], bool] = lambda op, status: False) -> None:
    """Up to `examples` derandomized cases of one schemathesis operation; nothing new starts past `deadline`."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy())
    def check(case):
        if time.monotonic() > deadline:
            return
        try:
            response = case.call(base_url=base_url, headers=headers, timeout=timeout)
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{op.label} {case.body!r} -> {type(exc).__name__}: {exc}")
            return
        if response.status_code >= 500 and not allowed_5xx(op, response.status_code):
            failures.append(f"{op.label} {case.body!r} -> {response.status_code} {response.text[:200]}")

    check()
