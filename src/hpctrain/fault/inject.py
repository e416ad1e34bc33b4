"""Fault injection for tests: HPCTRAIN_FAULT='ACTION:rank=R:step=S[:phase=P][:seconds=N][:signal=NAME]'.

Actions, fired once when rank R enters phase P (default 'forward') of step S
(steps counted as optimizer steps done, so step=S fires inside step S+1):
  hang    sleep N seconds (default 3600) - a stuck rank (alive: its other threads run)
  slow    sleep N seconds at EVERY mark of phase P in step S - a long phase that progresses (validation batches)
  freeze  sleep N seconds holding the interpreter lock - a frozen rank (no thread of it runs Python)
  crash   raise RuntimeError - an exception in one rank
  kill    SIGKILL itself - a rank that dies without a word
  signal  send itself a signal (default SIGTERM) - a preemption that reaches one rank
Several specs are separated by ';'. Not for production use; tests only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

ACTIONS = ("hang", "slow", "freeze", "crash", "kill", "signal")


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int
    step: int
    phase: str = "forward"
    seconds: float = 3600.0
    signal: str = "SIGTERM"


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (p.strip() for p in spec.split(";"))):
        action, *fields = item.split(":")
        if action not in ACTIONS:
            raise ValueError(f"HPCTRAIN_FAULT: unknown action '{action}' (choose from {', '.join(ACTIONS)})")
        kv = dict(f.split("=", 1) for f in fields)
        faults.append(Fault(
            action=action, rank=int(kv["rank"]), step=int(kv["step"]), phase=kv.get("phase", "forward"),
            seconds=float(kv.get("seconds", 3600)), signal=kv.get("signal", "SIGTERM"),
        ))
    return faults


def build_injector(spec: str, rank: int) -> Callable[[str, int], None] | None:
    mine = [f for f in parse_faults(spec) if f.rank == rank] if spec else []
    if not mine:
        return None
    fired: set[Fault] = set()

    def inject(phase: str, step: int) -> None:
        for fault in mine:
            if fault not in fired and fault.step == step and fault.phase == phase:
                if fault.action != "slow":
                    fired.add(fault)
                _fire(fault)

    return inject


def _fire(fault: Fault) -> None:
    if fault.action in ("hang", "slow"):
        time.sleep(fault.seconds)
    elif fault.action == "freeze":
        # libc's sleep called through PyDLL keeps the GIL: the watchdog thread cannot beat, as in a C call
        # that never returns or a process stopped with its lock held.
        ctypes.PyDLL(None).sleep(int(fault.seconds))
    elif fault.action == "crash":
        raise RuntimeError(f"injected crash on rank {fault.rank} at step {fault.step} ({fault.phase})")
    elif fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "signal":
        os.kill(os.getpid(), getattr(signal, fault.signal))
