"""Logging set-up shared by every service: one line per record, the service's name in each line.

`STEPLOOP_LOG_FORMAT` (every service's `--log-format`) picks the shape: `text` (default) for people, `json` for
log pipelines: one JSON object per line with ts, level, service, logger, msg, any `extra={...}` fields given to
the log call, and exc (the traceback) when there is one.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

from steploop.common import envs

LOG_FORMATS = ("text", "json")
# LogRecord attributes that are not `extra` fields.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                   timespec="milliseconds"),
               "level": record.levelname, "service": self.service, "logger": record.name,
               "msg": record.getMessage()}
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(service: str) -> None:
    level = os.environ.get(envs.LOG_LEVEL, "INFO").upper()
    fmt = os.environ.get(envs.LOG_FORMAT, "text").lower()
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)-7s [{service}] %(name)s: %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
