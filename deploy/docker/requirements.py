"""Prints steploop's own requirements (from the installed wheel's metadata, so pyproject.toml stays the one list)
less those of the named role's image does not need, one per line for `pip install -r`.

    python3 requirements.py scheduler     everything but the gateway's tokenizer stack

tests/deploy/test_scheduler_image_deps.py checks that the scheduler imports none of SCHEDULER_LEAVES_OUT."""

from __future__ import annotations

import re
import sys
from importlib.metadata import requires

# The gateway's tokenizer and request-validation stack: the scheduler works on token ids only.
SCHEDULER_LEAVES_OUT = frozenset({"transformers", "tokenizers", "numpy", "jinja2", "jsonschema"})


def name_of(requirement: str) -> str:
    return re.split(r"[ ;<>=!~\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requirements(leave_out: frozenset[str]) -> list[str]:
    return [r for r in requires("steploop") or [] if "extra ==" not in r and name_of(r) not in leave_out]


if __name__ == "__main__":
    roles = {"scheduler": SCHEDULER_LEAVES_OUT}
    if len(sys.argv) != 2 or sys.argv[1] not in roles:
        sys.exit(f"usage: requirements.py {{{','.join(roles)}}}")
    print("\n".join(requirements(roles[sys.argv[1]])))
