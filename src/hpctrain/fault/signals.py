"""Signal handlers that only record: the loop acts at the next optimizer-step boundary.

Doing work in a handler (saving, exiting) is unsafe: the signal can land inside a
collective, a CUDA call or a half-written file, and the other ranks would not know.
"""

from __future__ import annotations

import signal
import time
from types import FrameType


SAME_PRESS_S = 1.0
"""Two SIGINTs this close are one Ctrl-C: under Slurm every process of the step gets the signal and hpctrain's
torchrun wrapper forwards it too, so a rank sees one press twice within milliseconds."""


class StopSignals:
    """Records the last stop signal received (its number; 0 for none). SIGINT (Ctrl-C) is one too: the first stops
    the run at the next step boundary with a checkpoint, as SIGTERM does; a second raises KeyboardInterrupt there and
    then, for a user who will not wait for the step or the save."""

    def __init__(self) -> None:
        self.received = 0
        self.interrupted_at = 0.0
        """time.monotonic() of the first SIGINT (0: none)."""
        self.received_at = 0.0
        """time.monotonic() of the first stop signal: how long the stop took is said in the log."""
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        now = time.monotonic()
        if signum == signal.SIGINT:
            first = self.interrupted_at
            if first and now - first > SAME_PRESS_S:
                raise KeyboardInterrupt  # the second Ctrl-C: stop at once
            self.interrupted_at = first or now
            # A stop the cluster asked for (SIGTERM at the time limit, a preemption warning) keeps its meaning:
            # requeue and alert, not "the user stopped it".
            if self.received and self.received != signal.SIGINT:
                return
        self.received = signum
        self.received_at = self.received_at or now

    def install(self, names: list[str]) -> "StopSignals":
        for name in names:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def ignore_from_now(self) -> None:
        """After a stop is handled: ignore further stop signals until exit. Not a Python handler, because
        CPython resets those to the default (die) at interpreter shutdown, and torchrun SIGTERMs a worker
        still finishing its exit as soon as another worker has exited."""
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()


def stop_signal_names(warning_signal: str) -> list[str]:
    """SIGTERM always (Slurm's time limit and preemption send it), SIGINT (Ctrl-C: stop with a checkpoint, not lose
    the work since the last one), plus the configured warning signal."""
    return ["SIGTERM", "SIGINT"] + ([warning_signal] if warning_signal not in ("none", "SIGTERM", "SIGINT") else [])


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
