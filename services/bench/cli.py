"""`steploop bench <command>`:

    steploop bench serve     load-test an OpenAI-compatible server (TTFT, TPOT, ITL, E2E, throughput, goodput)

The side-by-side comparisons (steploop vs transformers, gRPC vs in-process, prefix caching, chunked prefill)
are one script: python benchmarks/compare.py [--quick].
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return
    if argv[0] != "serve":
        print(__doc__.strip())
        sys.exit(f"\nunknown bench command {argv[0]!r}")
    from steploop.bench.serve import main as serve_main
    serve_main(argv[1:])
