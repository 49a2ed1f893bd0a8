"""--log-format json: one JSON object per line with the fixed keys and the call's extra fields."""

from __future__ import annotations

import json
import logging

from steploop.common.log import JsonFormatter


def test_json_lines_carry_fixed_keys_and_extras():
    record = logging.LogRecord("steploop.scheduler.stats", logging.INFO, __file__, 1, "finished %s", ("r1",), None)
    record.__dict__.update({"request_id": "r1", "output_tokens": 7})
    line = json.loads(JsonFormatter("scheduler").format(record))
    assert {k: line[k] for k in ("level", "service", "logger", "msg", "request_id", "output_tokens")} == {
        "level": "INFO", "service": "scheduler", "logger": "steploop.scheduler.stats", "msg": "finished r1",
        "request_id": "r1", "output_tokens": 7}
    assert line["ts"].endswith("+00:00")
