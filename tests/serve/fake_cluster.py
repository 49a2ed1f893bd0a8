"""The real Supervisor over three fake services, as its own process (the tests signal it as a terminal would).

    python -m tests.serve.fake_cluster EVENTS_FILE DRAIN_SECONDS
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from steploop.supervisor import ServiceSpec, Supervisor


def main() -> None:
    events_path, drain_s = sys.argv[1], sys.argv[2]
    logging.basicConfig(level=logging.INFO, format="%(message)s")     # the tests read the children's pids
    specs = [ServiceSpec(name, [sys.executable, "-m", "tests.serve.fake_service", name, events_path, drain_s],
                         dict(os.environ)) for name in ("scheduler", "worker", "gateway")]
    # Nothing answers this URL: the fake cluster is never "ready", which changes nothing about stopping.
    supervisor = Supervisor(specs, health_url="http://127.0.0.1:9/health", stop_timeout=60,
                            stop_order=["gateway", "scheduler", "worker"])
    sys.exit(asyncio.run(supervisor.run()))


if __name__ == "__main__":
    main()
