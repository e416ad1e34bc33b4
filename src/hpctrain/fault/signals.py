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


FORWARDED_STOPS = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
"""Every signal hpctrain's launcher forwards to its workers (launch.FORWARDED) means a stop at a step boundary with
a checkpoint and exit code fault.exit_code (75: resume me), in a worker, a single process and an srun task alike:
SIGTERM (Slurm's time limit, preemption), SIGUSR1/SIGUSR2 (whichever a site's --signal or scancel --signal uses),
SIGHUP (a dropped SSH session or terminal). One code for all of them, because the run is unfinished with a
checkpoint in each case, the step vote picks one signal for all ranks when they got different ones, and any of the
three may be fault.warning_signal. Without a handler each of them would kill the process without a checkpoint."""


def stop_signal_names(warning_signal: str) -> list[str]:
    """The forwarded stops (FORWARDED_STOPS), SIGINT (Ctrl-C: stop with a checkpoint, exit 130, not lose the work
    since the last one), and the configured warning signal should it be another."""
    names = ["SIGINT", *FORWARDED_STOPS]
    return names + ([warning_signal] if warning_signal not in ("none", *names) else [])


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
