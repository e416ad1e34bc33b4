"""Local multi-process launch through torchrun (torch.distributed.run), not a spawner of our own.

The command's own process runs torchrun (hpctrain.launch), which starts each worker in a session of its own, so a
Ctrl-C reaches the workers once, through the launcher; PR_SET_PDEATHSIG in each worker makes it receive SIGTERM if
the launcher dies, so no orphaned workers survive it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from typing import Sequence

_PR_SET_PDEATHSIG = 1


def torchrun_args(nproc_per_node: int, module_args: Sequence[str]) -> list[str]:
    """torchrun's arguments for a local launch of ``python -m hpctrain MODULE_ARGS`` on ``nproc_per_node``."""
    return [
        "--standalone",  # c10d rendezvous on a free local port
        f"--nproc-per-node={nproc_per_node}",
        "-m", "hpctrain", *module_args,
    ]


def die_with_parent() -> None:
    """SIGTERM to this process when its parent dies (in a child between fork and exec, or a worker at its start)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # pragma: no cover - not glibc Linux
        pass


def stop_with_launcher(launcher_pid: int) -> None:
    """A worker of hpctrain's torchrun (``launcher_pid``, from its environment): a SIGKILLed launcher (OOM killer,
    kill -9) cannot pass anything on, and torchrun starts each worker in a session of its own, so without this the
    workers would train on, orphaned. With it they get SIGTERM, a stop signal: they save at the next step boundary
    and exit. A parent other than the launcher (it died before this ran, or the mark leaked into the environment of
    another launch) gets nothing armed, and a dead launcher the same SIGTERM at once."""
    if os.getppid() != launcher_pid:
        if not _alive(launcher_pid):
            os.kill(os.getpid(), signal.SIGTERM)
        return
    die_with_parent()
    if os.getppid() != launcher_pid:  # it died between the check and the request
        os.kill(os.getpid(), signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def oversubscription(nproc_per_node: int, environ: dict[str, str], cores: int) -> str | None:
    """One warning line when the workers' intra-op threads (OMP_NUM_THREADS each; torchrun sets 1 where it is
    unset for several workers) outnumber the cores this job may use (``cores``: os.sched_getaffinity), else None.
    Oversubscribed OpenMP threads wait for each other at every parallel op: 2 processes x 2 threads on 2 cores were
    reported about 5 times slower than with 1 thread each, without a word."""
    value = environ.get("OMP_NUM_THREADS", "")
    threads = int(value) if value.isdigit() and int(value) > 0 else 1
    if nproc_per_node * threads <= cores:
        return None
    fits = max(1, cores // nproc_per_node)
    return (f"hpctrain: {nproc_per_node} processes x OMP_NUM_THREADS={threads} = {nproc_per_node * threads} compute "
            f"threads on the {cores} core(s) this job may use: they will wait for each other at every op; set "
            f"OMP_NUM_THREADS={fits}" + ("" if nproc_per_node <= cores else " and fewer processes per node"))


def is_clean_stop_line(record: logging.LogRecord, codes: frozenset[int]) -> bool:
    """torchrun's ``failed (exitcode: 75) local_rank: ...`` where 75 is a stop with a checkpoint (fault.exit_code)
    or 130 (Ctrl-C): hpctrain's own line says what happened; a user reads torchrun's as an error."""
    return (isinstance(record.msg, str) and record.msg.startswith("failed (exitcode: ")
            and bool(record.args) and isinstance(record.args, tuple) and record.args[0] in codes)


class CleanStopLines(logging.Filter):
    """Drops is_clean_stop_line records from torchrun's logger; every other exit code still shows."""

    def __init__(self, codes: frozenset[int]) -> None:
        super().__init__()
        self.codes = codes

    def filter(self, record: logging.LogRecord) -> bool:
        return not is_clean_stop_line(record, self.codes)
