"""Heartbeats and the hang watchdog.

The training thread only sets a few attributes when it enters a phase (data, forward, backward, optimizer, sync,
eval, checkpoint): no I/O on the hot path. A daemon thread per rank (Watchdog) writes them to
RUN_DIR/heartbeat/rank_N.json every few seconds and reports a rank that has not changed phase for longer than
fault.hang_timeout_s, before the collective timeout ends the job: its phase, step, host, pid and Python stack, and
on rank 0 a table of all ranks, oldest progress first (in a hang, the rank that stopped first is usually the
culprit; the others wait for it in a collective).

A rank alive but stuck (in a collective, a blocked call) and a frozen one (SIGSTOP, a C call holding the
interpreter lock) are told apart, and phases slow by nature get fault.slow_phase_timeout_s: Watchdog says how.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

log = logging.getLogger("hpctrain")


EXITED = frozenset({"done", "failed", "stopped"})
"""The phases a watchdog writes last, on the way out (Watchdog.stop)."""
ALWAYS_SLOW = frozenset({"checkpoint"})
"""Phases whose length grows with the model, not with a hang: always the slow-phase limit."""


@dataclass
class Heartbeat:
    rank: int
    host: str
    pid: int = field(default_factory=os.getpid)
    step: int = 0
    phase: str = "start"
    since: float = field(default_factory=time.time)
    """Wall time of the last phase change: the last sign of progress."""
    slow: bool = True
    """This phase may take long without a hang (see ALWAYS_SLOW and first entries): the slow-phase limit applies."""
    on_mark: Callable[[str, int], None] | None = field(default=None, repr=False)
    """Called at every mark (fault injection in tests); None in normal runs."""
    _seen: set = field(default_factory=set, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """The watchdog thread must not see a new phase with the old one's start (a false hang after a slow phase)."""

    def mark(self, phase: str, step: int | None = None) -> None:
        with self._lock:  # uncontended: well under a microsecond, a few times per step
            if step is not None:
                self.step = step
            self.slow = phase in ALWAYS_SLOW or phase not in self._seen
            self._seen.add(phase)
            self.phase, self.since = phase, time.time()
        if self.on_mark is not None:
            self.on_mark(phase, self.step)

    def snapshot(self) -> dict:
        with self._lock:
            data = {k: getattr(self, k) for k in ("rank", "host", "pid", "step", "phase", "since", "slow")}
        return data | {"written": time.time()}


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # atomic; no fsync: a heartbeat lost in a crash costs nothing


def read_heartbeats(directory: Path) -> list[dict]:
    beats = []
    for path in sorted(directory.glob("rank_*.json")):
        try:
            beats.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return beats


def slow_phase_limit(slow_s: float, collective_timeout_s: float, beat_s: float) -> float:
    """fault.slow_phase_timeout_s, capped two beats below dist.timeout_s: a peer waiting for a slow phase longer
    than the collective timeout fails anyway, and a hang report after that would never be written."""
    return min(slow_s, max(collective_timeout_s - 2 * beat_s, beat_s))


@dataclass(frozen=True)
class Limits:
    hang_s: float
    """fault.hang_timeout_s: no progress for this long is a hang (0: never)."""
    slow_s: float
    """fault.slow_phase_timeout_s: the same for a slow phase."""
    beat_s: float
    """fault.heartbeat_every_s: how often an alive rank rewrites its file."""
    control_slow_s: float = 0.0
    """The slow-phase limit for phases whose waits are on the control plane (a checkpoint save: rank 0 writes,
    the others wait up to dist.control_timeout_s); 0: slow_s."""

    def for_beat(self, beat: dict) -> float:
        if beat.get("phase") in ALWAYS_SLOW and self.control_slow_s:
            return max(self.hang_s, self.control_slow_s)
        return max(self.hang_s, self.slow_s) if beat.get("slow") else self.hang_s

    @property
    def frozen_after_s(self) -> float:
        """A file not rewritten for this long belongs to a frozen or stopped process: 3 missed beats and 2 s for
        a slow shared filesystem, but below the hang limit, so a frozen rank is stale when rank 0 reports.
        Rank 0 compares other nodes' clocks with its own: cluster nodes run NTP (well under a second apart);
        a node whose clock is off by more than this would be misreported."""
        wanted = 3 * self.beat_s + 2
        return min(wanted, max(2 * self.beat_s, self.hang_s - self.beat_s)) if self.hang_s else wanted


WAITING_PHASES = frozenset({"backward", "sync"})
"""Phases in which a rank waits for its peers every step (DDP's gradient all-reduce, the step vote): a rank stuck
there is more likely the consequence of a peer stuck elsewhere than the cause."""


def stuck_ranks(beats: list[dict], now: float, limits: Limits) -> list[dict]:
    """Ranks without progress for longer than their phase's limit, likely causes first: ranks stuck where no peer
    is awaited before those waiting in a collective, then the one that stopped first first (the two can be a
    millisecond apart: a rank that hangs entering its forward, its peer entering the backward's all-reduce);
    each with stuck_s, and unwritten_s when its file is stale (the process itself is frozen or stopped)."""
    stale = []
    for b in beats:
        unwritten = now - b.get("written", now)
        exited = b["phase"] in EXITED  # its last file, written on the way out: not frozen, just gone
        frozen = unwritten > limits.frozen_after_s and not exited  # whatever its last phase's limit: not current
        if b["phase"] == "done" or not (frozen or now - b["since"] > limits.for_beat(b)):
            continue
        stale.append(b | {"stuck_s": now - b["since"], "frozen": frozen, "unwritten_s": unwritten})
    return sorted(stale, key=lambda b: (b["phase"] in WAITING_PHASES and not b["frozen"], b["since"]))


def format_stuck(stale: list[dict]) -> str:
    return "\n".join(_describe(b) for b in stale)


def _describe(b: dict) -> str:
    who = f"  rank {b['rank']} on {b['host']} (pid {b['pid']})"
    if b["phase"] in EXITED:
        return f"{who}: exited ({b['phase']}) at step {b['step']}"
    if b.get("frozen"):
        return (f"{who}: process frozen or stopped (heartbeat not written for {b['unwritten_s']:.0f} s); "
                f"last seen in phase '{b['phase']}' at step {b['step']}; its stacks, if it could write them: "
                f"heartbeat/frozen_rank_{b['rank']}.txt")
    return f"{who}: phase '{b['phase']}' at step {b['step']}, no progress for {b['stuck_s']:.0f} s"


class Watchdog(threading.Thread):
    """Two kinds of stuck rank are told apart. Alive but stuck (waiting in a collective, a sleeping or blocked call):
    its watchdog thread still writes the file, so the phase in it is current; the report goes to
    heartbeat/stuck_rank_N.txt. Frozen or stopped (SIGSTOP, a debugger, a C call that holds the interpreter lock):
    the file itself is no longer written, so its phase is only the last one seen, and the report says so. For that
    case each rank arms faulthandler.dump_traceback_later, re-armed by every beat: it runs in a C thread that needs
    no interpreter lock, and when the beats stop it writes every thread's stack to heartbeat/frozen_rank_N.txt.

    Phases that are slow by nature get fault.slow_phase_timeout_s instead of fault.hang_timeout_s: a checkpoint
    save, and the first time a process enters any phase (the first forward may be torch.compile, the first step NCCL
    set-up and autotuning, the first data the loader workers' start, the first validation batch a recompile).
    Validation marks every batch, so a long but moving validation is progress."""
    def __init__(
        self, heartbeat: Heartbeat, directory: Path, every_s: float, hang_timeout_s: float,
        is_main: bool, on_hang: Callable[[list[dict]], None] | None = None, slow_timeout_s: float = 0.0,
        control_slow_timeout_s: float = 0.0,
    ) -> None:
        super().__init__(name="hpctrain-watchdog", daemon=True)
        self.hb, self.dir, self.every_s = heartbeat, directory, every_s
        self.limits = Limits(hang_timeout_s, slow_timeout_s, every_s, control_slow_timeout_s)
        self.is_main, self.on_hang = is_main, on_hang
        self._stop_event = threading.Event()
        self._reported_since: float | None = None
        self._main_ident = threading.main_thread().ident
        self._frozen_file = None
        self._lock = threading.Lock()  # a beat in flight and stop() must not interleave (the dump's file)

    @property
    def frozen_path(self) -> Path:
        return self.dir / f"frozen_rank_{self.hb.rank}.txt"

    def run(self) -> None:
        while not self._stop_event.wait(self.every_s):
            self.beat()

    def beat(self) -> None:
        with self._lock:
            if not self._stop_event.is_set():
                self._beat()

    def _beat(self) -> None:
        try:
            snapshot = self.hb.snapshot()
            _write_json(self.dir / f"rank_{self.hb.rank}.json", snapshot)
            if not self.limits.hang_s:
                return
            self._arm_frozen_dump()
            if time.time() - snapshot["since"] > self.limits.for_beat(snapshot) and self._reported_since != snapshot["since"]:
                self._reported_since = snapshot["since"]  # once per stall
                self._report()
        except Exception:  # the watchdog must never take training down
            log.exception("heartbeat watchdog error (training continues)")

    def _arm_frozen_dump(self) -> None:
        """If this thread cannot beat again within fault.hang_timeout_s (the process is frozen holding the
        interpreter lock), faulthandler's C thread writes every thread's stack. Re-arming replaces the previous
        timer. Not the slow-phase limit: slow phases run Python, and no Python thread runs in a frozen process."""
        if self._frozen_file is None:
            self._frozen_file = open(self.frozen_path, "a")  # noqa: SIM115 - faulthandler keeps writing to it
        faulthandler.dump_traceback_later(self.limits.hang_s + self.every_s, repeat=False, file=self._frozen_file)

    def _report(self) -> None:
        hb = self.hb
        frame = sys._current_frames().get(self._main_ident)  # noqa: SLF001 - the documented way to see another thread
        stack = "".join(traceback.format_stack(frame)) if frame else "(no stack)"
        stuck_for = time.time() - hb.since
        path = self.dir / f"stuck_rank_{hb.rank}.txt"
        with open(path, "w") as out:
            out.write(f"rank {hb.rank} on {hb.host} (pid {hb.pid}): phase '{hb.phase}' at step {hb.step}, "
                      f"no progress for {stuck_for:.0f} s\n\nPython stack of the training thread:\n{stack}\n"
                      "All threads (faulthandler, most recent call first):\n")
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
        log.error(
            "rank %d on %s (pid %d) has made no progress for %.0f s: phase '%s' at step %d; stack in %s",
            hb.rank, hb.host, hb.pid, stuck_for, hb.phase, hb.step, path,
        )
        if self.is_main:
            stale = stuck_ranks(read_heartbeats(self.dir), time.time(), self.limits)
            _write_json(self.dir / "hang_report.json", {"time": time.time(), "stuck": stale})
            log.error("hang: %d rank(s) without progress, the first to stop first:\n%s", len(stale), format_stuck(stale))
            if self.on_hang is not None:
                self.on_hang(stale)

    def stop(self, final_phase: str = "done") -> None:
        with self._lock:
            self._stop_event.set()
            self._disarm_frozen_dump()
        self.hb.mark(final_phase)
        try:
            _write_json(self.dir / f"rank_{self.hb.rank}.json", self.hb.snapshot())
        except OSError:
            pass

    def _disarm_frozen_dump(self) -> None:
        if self._frozen_file is None:
            return
        faulthandler.cancel_dump_traceback_later()
        self._frozen_file.close()
        self._frozen_file = None
        try:
            if self.frozen_path.stat().st_size == 0:  # never fired: no file to puzzle over
                self.frozen_path.unlink()
        except OSError:
            pass
