"""Sizes written the way people write them on command lines."""

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
