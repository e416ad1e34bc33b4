"""Parsers for the monitor logs: ``top -b`` snapshots and ``nvidia-smi dmon`` tables.

Both tools print for people, not programs; these parsers read what they print on the
systems we know (procps-ng top 3.3/4; nvidia-smi dmon with ``-o DT``) and skip what they
cannot read rather than fail, since a report must not break on a torn last line.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

_TOP_TIME = re.compile(r"^top - (\d+):(\d+):(\d+) ")
_CPU = re.compile(r"^%Cpu\(s\):.*?([\d.]+)\s*id,")
_MEM = re.compile(r"^(KiB|MiB|GiB) Mem\s*:\s*([\d.]+)\s*total,\s*([\d.]+)\s*free,\s*([\d.]+)\s*used")
_MEM_SCALE = {"KiB": 1 / 1024 / 1024, "MiB": 1 / 1024, "GiB": 1.0}


@dataclass
class TopSeries:
    seconds: list[float] = field(default_factory=list)
    """Seconds since the first snapshot (top prints the time of day only)."""
    cpu_busy: list[float] = field(default_factory=list)
    """Percent of all CPUs of the node not idle."""
    mem_used_gib: list[float] = field(default_factory=list)
    mem_total_gib: float = 0.0


def parse_top(text: str) -> TopSeries:
    out = TopSeries()
    clock: float | None = None
    start: float | None = None
    day = 0.0
    first = True
    for line in text.splitlines():
        if m := _TOP_TIME.match(line):
            t = int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3]) + day
            if clock is not None and t < clock:  # past midnight
                day += 86400
                t += 86400
            clock = t
            start = t if start is None else start
        elif (m := _CPU.match(line)) and clock is not None:
            if first:  # top's first %Cpu line averages since boot, not over the interval
                first = False
                continue
            out.seconds.append(clock - start)
            out.cpu_busy.append(100.0 - float(m[1]))
        elif (m := _MEM.match(line)) and clock is not None and len(out.mem_used_gib) < len(out.seconds):
            scale = _MEM_SCALE[m[1]]
            out.mem_total_gib = float(m[2]) * scale
            out.mem_used_gib.append(float(m[4]) * scale)
    while len(out.mem_used_gib) < len(out.seconds):
        out.mem_used_gib.append(math.nan)
    return out


@dataclass
class DmonTable:
    columns: list[str]
    """Column names from dmon's header, lower case: date, time, gpu, pwr, gtemp, sm, mem, fb, ..."""
    rows: list[dict[str, float | str]]

    def gpus(self) -> list[str]:
        return sorted({str(r["gpu"]) for r in self.rows}, key=lambda g: int(g) if g.isdigit() else 0)

    def series(self, gpu: str, column: str) -> tuple[list[float], list[float]]:
        """(seconds since the first row, values) of one GPU; NaN where dmon printed '-'."""
        rows = [r for r in self.rows if str(r["gpu"]) == gpu and column in r]
        t0 = _dmon_seconds(self.rows[0]) if self.rows else 0.0
        return [_dmon_seconds(r) - t0 for r in rows], [float(r[column]) for r in rows]


def _dmon_seconds(row: dict) -> float:
    date, clock = str(row.get("date", "")), str(row.get("time", "00:00:00"))
    try:
        return datetime.strptime(f"{date} {clock}", "%Y%m%d %H:%M:%S").timestamp()
    except ValueError:  # dmon without -o D: time of day only
        h, m, s = (int(x) for x in clock.split(":"))
        return float(h * 3600 + m * 60 + s)


def parse_dmon(text: str) -> DmonTable:
    columns: list[str] = []
    rows: list[dict[str, float | str]] = []
    for line in text.splitlines():
        if line.startswith("#"):
            names = line[1:].split()
            if not columns and names and names[0].lower() in ("date", "time", "gpu"):
                columns = [n.lower() for n in names]
            continue
        parts = line.split()
        if not columns or len(parts) != len(columns):
            continue
        row: dict[str, float | str] = {}
        for name, value in zip(columns, parts):
            if name in ("date", "time", "gpu"):
                row[name] = value
            else:
                try:
                    row[name] = float(value)
                except ValueError:
                    row[name] = math.nan
        rows.append(row)
    return DmonTable(columns, rows)


def node_logs(monitor_dir: Path, prefix: str) -> dict[str, Path]:
    """host -> log file, for files named PREFIX_HOST.log."""
    return {p.stem[len(prefix) + 1:]: p for p in sorted(monitor_dir.glob(f"{prefix}_*.log"))}


def parse_parsable(text: str) -> list[dict[str, str]]:
    """sstat/sacct --parsable2 output (header line, '|'-separated)."""
    lines = [ln for ln in text.splitlines() if "|" in ln]
    if len(lines) < 2:
        return []
    header = lines[0].split("|")
    return [dict(zip(header, ln.split("|"))) for ln in lines[1:]]
