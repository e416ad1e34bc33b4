"""A sweep's grid: axes from `--grid KEY=V1,V2,...`, their points in a fixed order, and readable point names; in a
script's sweep, the axes that are the script's arguments (a KEY without a dot) and each point's arguments.

Pure functions (tested alone): nothing here resolves a config or touches a file.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass

from hpctrain.errors import UserError

MAX_NAME = 120
"""Longest point name (a run dir's name): longer ones are cut and given a hash."""
MAX_POINTS = 1000
"""A bigger grid is refused unless asked for (--allow-large): a typo in an axis should not queue 10,000 jobs."""
FIXED_KEYS = ("run.dir", "run.name", "slurm.", "fault.warning_signal")
"""Keys a sweep does not vary: run.dir and run.name are each point's own; the points share one job script (its
shape, and the signal its shell traps). run.seed may be an axis."""


@dataclass(frozen=True)
class Axis:
    key: str
    """A dotted config key, e.g. optim.lr."""
    values: tuple[str, ...]
    """Its values as typed (each read with the command line's TOML rules when a point is resolved)."""


@dataclass(frozen=True)
class Point:
    index: int
    """Its array index (0-based), the order of the product of the axes, the first axis slowest."""
    name: str
    """Its run dir's name in the sweep dir, e.g. p003_lr=4e-4_micro_batch_size=64."""
    settings: tuple[tuple[str, str], ...]
    """(key, value) per axis."""

    @property
    def overrides(self) -> tuple[str, ...]:
        """The point's hpctrain settings as key=value (a script's arguments left out)."""
        return tuple(f"{k}={v}" for k, v in self.settings if not is_script_axis(k))


def is_script_axis(key: str) -> bool:
    """An axis over a script's argument: a KEY without a dot (hpctrain's keys are section.key)."""
    return "." not in key


def script_args_of(base: tuple[str, ...], settings: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """A point's arguments for the script: ``base`` (those after --), with each script axis KEY=VALUE either put
    where ``base`` holds {KEY}, or appended as --KEY VALUE (a KEY that starts with '-' as it is: -l VALUE)."""
    args = list(base)
    for key, value in settings:
        if not is_script_axis(key):
            continue
        slot = "{" + key.lstrip("-") + "}"
        if any(slot in a for a in args):
            args = [a.replace(slot, value) for a in args]
        else:
            args += [key if key.startswith("-") else f"--{key}", value]
    return tuple(args)


def parse_axis(text: str) -> Axis:
    """KEY=V1,V2,... (commas inside [...] or quotes belong to a value: --grid model.ch_mult=[1,2],[1,2,2])."""
    key, eq, rest = text.partition("=")
    key = key.strip()
    if not eq or not key or not rest.strip():
        raise UserError(f"--grid {text!r}: expected KEY=VALUE1,VALUE2,...", "e.g. --grid optim.lr=1e-4,2e-4,4e-4")
    if key in FIXED_KEYS or key.startswith("slurm."):
        raise UserError(f"--grid {key}: a sweep does not vary run.dir, run.name, slurm.* or fault.warning_signal",
                        "each point gets its own run dir in the sweep dir, and all points share one job script (set "
                        "slurm.* once, as key=value after the experiment); sweep job shapes as separate sweeps.")
    values = tuple(v.strip() for v in _split(rest))
    if any(not v for v in values):
        raise UserError(f"--grid {text!r}: an empty value", "separate values with single commas, e.g. 1e-4,2e-4")
    if len(set(values)) != len(values):
        raise UserError(f"--grid {text!r}: a value is repeated", "list each value once.")
    return Axis(key, values)


def _split(text: str) -> list[str]:
    out, depth, quote, current = [], 0, "", []
    for c in text:
        if quote:
            quote = "" if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == "," and depth == 0:
            out.append("".join(current))
            current = []
            continue
        current.append(c)
    out.append("".join(current))
    return out


def grid_points(axes: list[Axis], allow_large: bool = False) -> list[Point]:
    """Every combination, the first axis varying slowest; refused above MAX_POINTS unless allow_large."""
    if not axes:
        raise UserError("no --grid given: a sweep needs at least one axis", "e.g. --grid optim.lr=1e-4,2e-4,4e-4")
    keys = [a.key for a in axes]
    if len(set(keys)) != len(keys):
        raise UserError(f"--grid names {sorted(k for k in set(keys) if keys.count(k) > 1)} twice",
                        "give each key one --grid with all its values.")
    count = 1
    for a in axes:
        count *= len(a.values)
    if count > MAX_POINTS and not allow_large:
        raise UserError(f"the grid has {count:,} points (over {MAX_POINTS:,})",
                        "check the axes for a typo, or pass --allow-large if you mean it.")
    labels = _labels(keys)
    points = []
    for i, values in enumerate(itertools.product(*(a.values for a in axes))):
        settings = tuple(zip(keys, values))
        name = f"p{i:0{max(3, len(str(count - 1)))}d}_" + "_".join(f"{labels[k]}={_safe(v)}" for k, v in settings)
        if len(name) > MAX_NAME:  # file names stop at 255 bytes; the index keeps names unique, a hash keeps them apart
            name = name[:MAX_NAME - 9] + "_" + hashlib.sha256(name.encode()).hexdigest()[:8]
        points.append(Point(i, name, settings))
    return points


def _labels(keys: list[str]) -> dict[str, str]:
    """A key's last part (optim.lr -> lr), or the whole key where two axes share a last part."""
    last = [k.rsplit(".", 1)[-1].lstrip("-") for k in keys]
    return {k: (l if last.count(l) == 1 else k.lstrip("-")) for k, l in zip(keys, last)}


def _safe(value: str) -> str:
    """A value as a file-name part: letters, digits and . + - kept, anything else a '-' (at most 40 characters; a
    leading minus sign kept: -1 stays -1)."""
    out = re.sub(r"[^A-Za-z0-9.+-]+", "-", value).rstrip("-")
    return (out if value.startswith("-") else out.lstrip("-"))[:40] or "x"
