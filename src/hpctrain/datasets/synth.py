"""`hpctrain synth faces OUT`: the generated face set (:mod:`hpctrain.datasets.faces`) written whole or not at all."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from hpctrain.errors import UserError

log = logging.getLogger("hpctrain")


def synth_faces(out: Path, count: int, size: int, seed: int) -> Path:
    """Generate into OUT.tmp-PID, then rename to OUT: an interrupted run leaves no half set under OUT."""
    from hpctrain.datasets.faces import make_faces

    if count < 10:
        raise UserError(f"--count {count} is too few for a train/val/test split", "use at least 10 (e.g. 3000).")
    if not 32 <= size <= 2048:
        raise UserError(f"--size {size} is outside 32..2048 pixels", "e.g. 256 (CelebAMask-HQ is 1024).")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"'{out}' already exists and is not an empty folder", "choose a new folder, or remove it.")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    started = time.perf_counter()
    try:
        make_faces(tmp, count, size=size, mask_size=max(16, size // 2), seed=seed, standard_split=True)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("generated %d faces (%dx%d) in %.1f s", count, size, size, time.perf_counter() - started)
    return out
