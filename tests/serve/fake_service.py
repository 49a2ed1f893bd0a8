"""A stand-in service for the supervisor's tests: notes every signal it gets in a shared file, and on SIGTERM
"drains" for a given time before it exits.

    python -m tests.serve.fake_service NAME EVENTS_FILE DRAIN_SECONDS
"""

from __future__ import annotations

import signal
import sys
import time


def main() -> None:
    name, events_path, drain_s = sys.argv[1], sys.argv[2], float(sys.argv[3])

    def note(event: str) -> None:
        with open(events_path, "a") as events:
            events.write(f"{name} {event}\n")

    terminated = []
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))
    signal.signal(signal.SIGINT, lambda *_: note("SIGINT"))     # a terminal's Ctrl-C must never reach here
    note("ready")
    while not terminated:
        time.sleep(0.02)
    note("SIGTERM")
    time.sleep(drain_s)
    note("stopped")


if __name__ == "__main__":
    main()
