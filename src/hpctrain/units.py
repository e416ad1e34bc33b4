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
