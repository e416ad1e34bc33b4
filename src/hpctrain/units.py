"""Sizes and durations written the way people write them: on command lines, and in Slurm's time limits
(parsed the way sbatch documents them: "minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours",
"days-hours:minutes", "days-hours:minutes:seconds"; "UNLIMITED"/"INFINITE" mean none)."""

from __future__ import annotations

import re

from hpctrain.errors import UserError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'1GB' -> 10**9, '64MiB' -> 64 * 2**20, '1000' -> 1000 bytes."""
    m = _SIZE.match(text)
    if not m:
        raise UserError(f"cannot read the size '{text}'", "write e.g. 1GB, 500MB, 64MiB or a number of bytes.")
    number, unit = float(m.group(1)), m.group(2).upper()
    power = "KMGT".find(unit[:1]) + 1 if unit[:1] in ("K", "M", "G", "T") else 0
    return int(number * (1024 if "I" in unit else 1000) ** power)


def format_size(n: float) -> str:
    """Bytes for a log line or a message: '950 MB', '12.3 GB' (decimal units, as parse_size reads 'GB')."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 100 else f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"


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
