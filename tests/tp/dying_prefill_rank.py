"""The real worker (`python -m tests.tp.dying_prefill_rank`, any gpu_worker flag) that SIGKILLs itself the first
time a plan asks it to send KV blocks: a prefill rank lost mid-transfer, while its group's other ranks wait for its
heads. Deterministic, no timing involved; nothing in the production code knows about this module."""

from __future__ import annotations

import os
import signal
import sys


def main() -> int:
    from steploop.gpu_worker import kv_transfer, server

    original = kv_transfer.KvSender.apply

    def apply(self, moves, report):
        if moves.sends:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, moves, report)

    kv_transfer.KvSender.apply = apply
    return server.main()


if __name__ == "__main__":
    sys.exit(main())
