"""Slurm's time-limit syntax, parsed the way sbatch documents it.

"minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours",
"days-hours:minutes" and "days-hours:minutes:seconds"; "UNLIMITED"/"INFINITE" mean none.
"""

from __future__ import annotations

import re

_DAYS = re.compile(r"^(\d+)-(\d+)(?::(\d+))?(?::(\d+))?$")
_CLOCK = re.compile(r"^(\d+)(?::(\d+))?(?::(\d+))?$")


def time_limit_seconds(text: str) -> int | None:
    """Seconds in a Slurm time limit; None for unlimited. ValueError for text Slurm would reject."""
    text = text.strip()
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    if m := _DAYS.match(text):
        days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
        return ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if m := _CLOCK.match(text):
        parts = [int(g) for g in m.groups() if g is not None]
        if len(parts) == 1:
            return parts[0] * 60
        if len(parts) == 2:
            return parts[0] * 60 + parts[1]
        return (parts[0] * 60 + parts[1]) * 60 + parts[2]
    raise ValueError(f"not a Slurm time limit: {text!r}")


def format_duration(seconds: float) -> str:
    """Short human form: 90 -> '1m30s', 7200 -> '2h00m'."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
