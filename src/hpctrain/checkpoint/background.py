"""One checkpoint write at a time, in a thread: the training loop waits only when it saves again.

A thread, not a process: the snapshot is already a private CPU copy, torch.save and sha256 release
the GIL for the large writes, and a thread needs no second copy of the state through a pipe.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

from hpctrain.threads import lower_priority

T = TypeVar("T")


class BackgroundWriter(Generic[T]):
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._outcome: T | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def submit(self, write: Callable[[], T]) -> None:
        """Start ``write`` (which reports failures in its return value, never by raising)."""
        if self._thread is not None:
            raise RuntimeError("a checkpoint write is still running; wait() for it first")

        def run() -> None:
            lower_priority()
            self._outcome = write()

        # Not a daemon: a process that ends (even by an exception elsewhere) finishes the write it
        # started, because the snapshot it holds is a good checkpoint. SIGKILL cannot be helped, and
        # the write protocol (temporary directory, manifest last) leaves the previous one valid then. The
        # commit is still subject to the Checkpointer's commit_allowed (the run dir lock, train/run.py waits for
        # this thread before releasing it): a write that outlived a lost lock is dropped, not committed.
        self._thread = threading.Thread(target=run, name="hpctrain-checkpoint-writer")
        self._thread.start()

    def wait(self) -> T | None:
        """The outcome of the write in flight (None when there was none), after it ends."""
        if self._thread is None:
            return None
        self._thread.join()
        outcome, self._thread, self._outcome = self._outcome, None, None
        return outcome
