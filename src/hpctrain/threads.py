"""Helper threads that must not compete with the training for CPU."""

from __future__ import annotations

import os
import threading


def lower_priority() -> None:
    """Nice 10 for the calling thread. On Linux nice applies per thread, and a process the thread starts inherits
    it: a background thread (the checkpoint writer hashing 500 MB, a tracker's client and the helper process it
    spawns) yields CPU to the training threads where cores are scarce, and costs nothing where they are not."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at the normal priority
        pass
