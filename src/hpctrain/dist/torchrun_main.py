"""torchrun, with a short failure report.

This is ``torch.distributed.run.main`` itself (the same argument parsing, agent and
rendezvous); we only catch its ChildFailedError, whose traceback and boxed summary
bury the workers' own messages, and report the first failure in one line with
that worker's exit code (2 for bad input, 128+N for signal N) instead of 1.
"""

from __future__ import annotations

import socket
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun


def exit_code(worker_exitcode: int) -> int:
    if worker_exitcode < 0:
        return 128 - worker_exitcode
    return worker_exitcode or 1


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun(argv)
    except ChildFailedError as err:
        rank, first = err.get_first_failure()
        others = len(err.failures) - 1
        print(
            f"hpctrain: worker rank {rank} (local rank {first.local_rank}, pid {first.pid}, {socket.gethostname()}) "
            f"failed first, exit code {first.exitcode}"
            + (f"; {others} more worker(s) failed after it" if others else "")
            + "; its messages are above.",
            file=sys.stderr,
        )
        return exit_code(first.exitcode)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
