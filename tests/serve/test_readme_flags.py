"""The README's flag tables cover every flag of every command: the generated section is what
scripts/readme_flags.py writes from the parsers now, and each option string of each parser is in the README."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("readme_flags", ROOT / "scripts" / "readme_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_flag_tables_are_up_to_date(monkeypatch):
    flags = load_script()
    monkeypatch.setenv("STEPLOOP_MAX_NUM_SEQS", "7")      # an environment must not leak into the documented defaults
    text = flags.README.read_text()
    section = flags.render()
    assert "`--max-num-seqs` | serve, scheduler, worker | `128` |" in section
    assert flags.rewrite(text, section) == text, "README.md's flag tables are stale: run python scripts/readme_flags.py"


def test_every_flag_of_every_command_is_in_the_readme_tables():
    flags = load_script()
    text = flags.README.read_text()
    tables = text[text.index(flags.BEGIN):text.index(flags.END)]
    every = [(command, name) for command, parser in flags.parsers().items() for action in flags.options(parser)
             for name in action.option_strings]
    assert len({command for command, _ in every}) == 6 and len(every) > 150, every   # serve ... bench serve
    missing = [f"{command} {name}" for command, name in every if f"`{name}`" not in tables]
    assert not missing, f"flags not in the README's flag tables: {missing}"
