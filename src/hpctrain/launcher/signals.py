"""Stop signals passed on to torchrun's workers, and the launcher's SIGKILL for those that do not stop.

torchrun's own handling (SIGTERM to the workers, then a SignalException traceback and exit 1) threw the work since
the last checkpoint away, and SIGUSR1/SIGUSR2 killed torchrun without a word to its workers. Here SIGTERM, SIGHUP,
SIGUSR1 and SIGUSR2 go to the worker processes (not the node monitors) while torchrun keeps running: the workers
stop at a step boundary, save and exit with fault.exit_code. Ctrl-C too; a second press stops them at once.
Workers still running a grace after a forwarded SIGTERM or a second Ctrl-C are killed; failures.report tells the
two apart (a failure, 137, or the user's interrupt, 130).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from hpctrain.fault.signals import FORWARDED_STOPS, SAME_PRESS_S
from hpctrain.monitor.sidecars import running_monitors

FORWARDED = tuple(getattr(signal, name) for name in FORWARDED_STOPS)

# After a forwarded SIGTERM the workers get this long to save and exit, then SIGKILL: torchrun's own
# backstop (30 s) is bypassed by forwarding, and a hung worker must not keep the launcher alive forever.
# Under Slurm, KillWait ends the step earlier anyway.
TERM_GRACE_S = 120

# After a second Ctrl-C the workers get this long to leave (their KeyboardInterrupt), then SIGKILL.
INTERRUPT_GRACE_S = 10
INTERRUPTED = 130


def child_pids(pid: int | None = None) -> list[int]:
    """Direct children of ``pid`` (torchrun's workers), from /proc."""
    pid = pid or os.getpid()
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


def worker_pids() -> list[int]:
    """torchrun's workers: this process's children but the node monitors (monitor/sidecars), which stop when the
    launch ends, not when a stop signal comes."""
    monitors = running_monitors()
    return [pid for pid in child_pids() if pid not in monitors]


def _kill_workers() -> frozenset[int]:
    """SIGKILL to every worker still running; the pids it reached (a worker's SIGKILL is ours only if its pid is
    among them: the OOM killer's is not, even while torchrun has yet to reap it)."""
    killed = set()
    for child in worker_pids():
        if _process_state(child) in ("", "Z"):
            continue
        try:
            os.kill(child, signal.SIGKILL)
            killed.add(child)
        except ProcessLookupError:
            pass
    return frozenset(killed)


def _process_state(pid: int) -> str:
    """The process state letter (Z: dead, not yet reaped), '' when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _kill_after_stop(_signum: int = signal.SIGALRM, _frame=None) -> None:
    """TERM_GRACE_S after a forwarded SIGTERM: the workers did not stop (a failure, said as such in report)."""
    _StopGrace.killed |= _kill_workers()


def _kill_after_interrupt(_signum: int = signal.SIGALRM, _frame=None) -> None:
    """INTERRUPT_GRACE_S after the second Ctrl-C: the user's interrupt (130), not a failure."""
    _Interrupts.killed |= _kill_workers()


class _StopGrace:
    killed: frozenset[int] = frozenset()
    """Workers the launcher SIGKILLed because they were still running TERM_GRACE_S after a forwarded SIGTERM."""


def _forward(signum: int, _frame) -> None:
    for child in worker_pids():
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass
    if signum == signal.SIGTERM:
        _kill_children_in(TERM_GRACE_S, _kill_after_stop)


def _kill_children_in(seconds: int, killer=_kill_after_interrupt) -> None:
    """SIGKILL to the workers ``seconds`` from now by ``killer`` (which records why), or sooner if already due sooner
    (a later signal never gives a stuck worker more time); the kill due first keeps its reason."""
    left = signal.alarm(0)
    if left and left <= seconds and signal.getsignal(signal.SIGALRM) in KILLERS:
        signal.alarm(left)
        return
    signal.signal(signal.SIGALRM, killer)
    signal.alarm(seconds)


KILLERS = (_kill_after_stop, _kill_after_interrupt)


class _Interrupts:
    """Ctrl-C: the first is forwarded (the workers stop at a step boundary with a checkpoint), the second too (the
    workers' KeyboardInterrupt), with SIGKILL INTERRUPT_GRACE_S later for a worker that does not leave. Two SIGINTs
    within SAME_PRESS_S are one press (under Slurm the step's signal reaches this process and the workers alike)."""

    count = 0
    first_at = 0.0
    killed: frozenset[int] = frozenset()
    """Workers the launcher SIGKILLed INTERRUPT_GRACE_S after the second press (_kill_after_interrupt)."""

    @classmethod
    def handle(cls, signum: int, frame) -> None:
        now = time.monotonic()
        if cls.count and now - cls.first_at <= SAME_PRESS_S:
            return  # the same press again: the workers have it
        cls.count += 1
        cls.first_at = cls.first_at or now
        _forward(signum, frame)
        if cls.count == 2:
            _kill_children_in(INTERRUPT_GRACE_S)


def _delivered_by_slurm(_signum: int, _frame) -> None:
    """A stop signal that Slurm delivered to every process of the job step, the workers included: nothing to pass
    on (each would get it twice), and the launcher must not die of it (the default for USR1/USR2 and TERM)."""


def forwarding(forward: bool = True) -> dict:
    """Installs the forwarding handlers for a launch (its presses and kills are its own); returns the caller's
    handlers, for restore_handlers. SIGQUIT keeps torchrun's behaviour: it is in the map only to be restored.
    ``forward`` False: the stop signals (SIGINT too) are received and passed on to nobody, for a job step whose
    workers Slurm signals itself (a script job: it cannot tell the second copy of a signal from a new one)."""
    _Interrupts.count, _Interrupts.first_at, _Interrupts.killed, _StopGrace.killed = 0, 0.0, frozenset(), frozenset()
    previous = {sig: signal.getsignal(sig) for sig in (*FORWARDED, signal.SIGINT, signal.SIGQUIT, signal.SIGALRM)}
    for sig in FORWARDED:
        signal.signal(sig, _forward if forward else _delivered_by_slurm)
    signal.signal(signal.SIGINT, _Interrupts.handle if forward else _delivered_by_slurm)
    return previous


def restore_handlers(previous: dict) -> None:
    """The caller's handlers again (torchrun's for SIGQUIT too); the workers' SIGKILL timer cancelled if armed
    (first the handlers that arm it, so none can arm it again)."""
    for sig, handler in previous.items():
        if sig != signal.SIGALRM:
            signal.signal(sig, handler)
    if signal.getsignal(signal.SIGALRM) in KILLERS:
        signal.alarm(0)
    signal.signal(signal.SIGALRM, previous[signal.SIGALRM])
