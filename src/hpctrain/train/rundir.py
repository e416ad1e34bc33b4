"""The run directory: created and checked before any process starts, written by rank 0 only."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path
from typing import Iterator

from hpctrain.atomic import atomic_write_text
from hpctrain.errors import UserError

SUBDIRS = ("checkpoints", "plots", "heartbeat")


def ensure_writable(run_dir: Path) -> None:
    """mkdir -p and prove we can write there, with a message that says what to do when not."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise UserError(
            f"run directory '{run_dir}' is not writable: {err.strerror or err}",
            "choose another run.dir (it must be on a file system every node can write), or fix its permissions.",
        ) from None


@contextlib.contextmanager
def removed_if_left_empty(run_dir: Path) -> Iterator[None]:
    """The folders of ``run_dir`` that do not exist yet, removed again if the launch leaves them empty: a run that
    failed before writing anything (a bad [model] option, found when the experiment is built) leaves no empty run
    dir behind. rmdir removes empty folders only: one that existed before, or holds anything, stays."""
    created = []
    for path in (run_dir, *run_dir.parents):
        if path.exists():
            break
        created.append(path)
    try:
        yield
    finally:
        for path in created:  # deepest first
            try:
                path.rmdir()
            except OSError:  # not empty (the run wrote there), or gone: keep what is left
                break


def write_config(run_dir: Path, config_text: str) -> None:
    """RUN_DIR/config.toml holds the resolved config. A different earlier one is kept as
    config.<time>.toml, so a resumed run with changed settings loses nothing."""
    path = run_dir / "config.toml"
    if path.exists():
        old = path.read_text(encoding="utf-8")
        if old == config_text:
            return
        os.replace(path, run_dir / f"config.{time.strftime('%Y%m%d-%H%M%S')}.toml")
    atomic_write_text(path, config_text)


RECORDS = ("metrics.jsonl", "tensorboard", "trackers")
"""What a run appends to: a fresh start must not add its lines to another run's (nor continue its tracker runs:
RUN_DIR/trackers holds their ids)."""


def set_aside_records(run_dir: Path) -> list[Path]:
    """On a fresh start (no checkpoint loaded) in a run dir that holds another attempt's records (one stopped before
    its first save, or another experiment's): move them aside as NAME.<time> so the report, the plots and TensorBoard
    show this run alone; returns the new names."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for name in RECORDS:
        path = run_dir / name
        if path.exists():
            stem, dot, suffix = name.partition(".")
            target = run_dir / (f"{stem}.{stamp}{dot}{suffix}" if dot else f"{name}.{stamp}")
            n = 1
            while target.exists():  # two fresh starts within a second: never onto an earlier attempt's
                n += 1
                target = run_dir / (f"{stem}.{stamp}-{n}{dot}{suffix}" if dot else f"{name}.{stamp}-{n}")
            os.replace(path, target)
            moved.append(target)
    return moved


def prepare_run_dir(run_dir: Path) -> None:
    """The run dir's folders. Its config.toml is written only once the checkpoint (if any) has loaded
    (write_config): a resume refused for a changed model key must leave the run dir as it was."""
    ensure_writable(run_dir)
    for name in SUBDIRS:
        (run_dir / name).mkdir(exist_ok=True)
