"""Heartbeats and the hang watchdog.

The training thread only sets a few attributes when it enters a phase (data,
forward, backward, optimizer, sync, eval, checkpoint): no I/O on the hot path. A
daemon thread per rank writes them to RUN_DIR/heartbeat/rank_N.json every few
seconds and watches for a rank that has not changed phase for longer than
fault.hang_timeout_s. Then it reports, before the collective timeout ends the
job: this rank's phase, step, host, pid and its main thread's Python stack
(heartbeat/stuck_rank_N.txt); and on rank 0 a table of all ranks from their
heartbeat files, oldest progress first: in a hang, the rank that stopped first is
usually the culprit, and the others wait for it in a collective.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

log = logging.getLogger("hpctrain")


@dataclass
class Heartbeat:
    rank: int
    host: str
    pid: int = field(default_factory=os.getpid)
    step: int = 0
    phase: str = "start"
    since: float = field(default_factory=time.time)
    """Wall time of the last phase change: the last sign of progress."""
    on_mark: Callable[[str, int], None] | None = field(default=None, repr=False)
    """Called at every mark (fault injection in tests); None in normal runs."""

    def mark(self, phase: str, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        self.phase, self.since = phase, time.time()
        if self.on_mark is not None:
            self.on_mark(phase, self.step)

    def snapshot(self) -> dict:
        data = asdict(self)
        data.pop("on_mark")
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


def stuck_ranks(beats: list[dict], now: float, hang_timeout_s: float) -> list[dict]:
    """Ranks without progress for longer than the timeout, the one that stopped first first."""
    stale = [b | {"stuck_s": now - b["since"]} for b in beats if b["phase"] != "done" and now - b["since"] > hang_timeout_s]
    return sorted(stale, key=lambda b: b["since"])


def format_stuck(stale: list[dict]) -> str:
    return "\n".join(
        f"  rank {b['rank']} on {b['host']} (pid {b['pid']}): phase '{b['phase']}' at step {b['step']}, "
        f"no progress for {b['stuck_s']:.0f} s" for b in stale
    )


class Watchdog(threading.Thread):
    def __init__(
        self, heartbeat: Heartbeat, directory: Path, every_s: float, hang_timeout_s: float,
        is_main: bool, on_hang: Callable[[list[dict]], None] | None = None,
    ) -> None:
        super().__init__(name="hpctrain-watchdog", daemon=True)
        self.hb, self.dir, self.every_s, self.hang_timeout_s = heartbeat, directory, every_s, hang_timeout_s
        self.is_main, self.on_hang = is_main, on_hang
        self._stop_event = threading.Event()
        self._reported_since: float | None = None
        self._main_ident = threading.main_thread().ident

    def run(self) -> None:
        while not self._stop_event.wait(self.every_s):
            self.beat()

    def beat(self) -> None:
        try:
            _write_json(self.dir / f"rank_{self.hb.rank}.json", self.hb.snapshot())
            if self.hang_timeout_s and time.time() - self.hb.since > self.hang_timeout_s:
                if self._reported_since != self.hb.since:  # once per stall
                    self._reported_since = self.hb.since
                    self._report()
        except Exception:  # the watchdog must never take training down
            log.exception("heartbeat watchdog error (training continues)")

    def _report(self) -> None:
        hb = self.hb
        frame = sys._current_frames().get(self._main_ident)  # noqa: SLF001 - the documented way to see another thread
        stack = "".join(traceback.format_stack(frame)) if frame else "(no stack)"
        stuck_for = time.time() - hb.since
        (self.dir / f"stuck_rank_{hb.rank}.txt").write_text(
            f"rank {hb.rank} on {hb.host} (pid {hb.pid}): phase '{hb.phase}' at step {hb.step}, "
            f"no progress for {stuck_for:.0f} s\n\nPython stack of the training thread:\n{stack}"
        )
        log.error(
            "rank %d on %s (pid %d) has made no progress for %.0f s: phase '%s' at step %d; stack in %s",
            hb.rank, hb.host, hb.pid, stuck_for, hb.phase, hb.step, self.dir / f"stuck_rank_{hb.rank}.txt",
        )
        if self.is_main:
            stale = stuck_ranks(read_heartbeats(self.dir), time.time(), self.hang_timeout_s)
            _write_json(self.dir / "hang_report.json", {"time": time.time(), "stuck": stale})
            log.error("hang: %d rank(s) without progress, the first to stop first:\n%s", len(stale), format_stuck(stale))
            if self.on_hang is not None:
                self.on_hang(stale)

    def stop(self, final_phase: str = "done") -> None:
        self._stop_event.set()
        self.hb.mark(final_phase)
        try:
            _write_json(self.dir / f"rank_{self.hb.rank}.json", self.hb.snapshot())
        except OSError:
            pass
