"""A process that ends with the one that started it: a worker with its launcher, a helper with its parent.

hpctrain's launcher (hpctrain.launcher) starts each worker in a session of its own, so a Ctrl-C reaches the workers
once, through the launcher; PR_SET_PDEATHSIG in each worker makes it receive SIGTERM if the launcher dies, so no
orphaned workers survive it.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


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
