"""Logging set-up shared by every service: one line per record, the service's name in each line."""

from __future__ import annotations

import logging
import os
import sys

from services.common import envs


def setup_logging(service: str) -> None:
    level = os.environ.get(envs.LOG_LEVEL, "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)-7s [{service}] %(name)s: %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
