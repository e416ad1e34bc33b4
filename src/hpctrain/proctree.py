"""A process's descendants, and killing them all: what a launcher-of-launchers needs to clean up after a hang.

Process groups are not enough: torchrun starts its workers in sessions of their own, so killpg on the
launcher's group does not reach them. /proc/PID/task/*/children lists each thread's children (Linux)."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before their children."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and everything below it. The list is taken first: once a parent is gone its children are
    re-parented and no longer found below it."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
