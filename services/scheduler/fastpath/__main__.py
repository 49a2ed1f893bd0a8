"""python -m steploop.scheduler.fastpath: build the scheduler's C loops into the cache and print the path (image
build stages run it; exit 1 when it cannot be built)."""

import logging
import sys

from steploop.scheduler.fastpath import build

logging.basicConfig(level=logging.INFO, format="%(message)s")
path = build()
print(path or "not built (see the warning above)")
sys.exit(0 if path else 1)
