"""What a tracker keeps in the run dir: RUN_DIR/trackers/NAME.json, written atomically, one file per tracker (each
is written by its own thread). It is what makes every launch of a training continue one tracker run: the run's id,
and the last step whose records all reached the tracker."""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.atomic import atomic_write_text

TRACKERS_DIR = "trackers"
"""RUN_DIR/trackers: the state files, W&B's offline runs and MLflow's default file store. A fresh start in a run
dir moves it aside with metrics.jsonl (train/rundir.py RECORDS), so a new training gets a new tracker run."""


@dataclass(frozen=True, kw_only=True)
class TrackerState:
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    """hpctrain's own id of the training, written before the tracker run exists: a run created by a launch that died
    before it could write run_id is found again by it (an MLflow tag), not created twice."""
    run_id: str = ""
    """The tracker's run id ('' until the tracker has made the run)."""
    sent_step: int = 0
    """Every record up to this step has reached the tracker (a resume sends those after it from metrics.jsonl)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Tracker-specific facts for the commands that read the state (W&B: mode, project, dir; MLflow: uri)."""


def state_path(run_dir: Path, name: str) -> Path:
    return run_dir / TRACKERS_DIR / f"{name}.json"


def read_state(run_dir: Path, name: str) -> TrackerState | None:
    """The state of tracker ``name`` in ``run_dir``; None when there is none (a new training) or it is unreadable
    (then a new tracker run is made: a damaged file must not stop the training)."""
    try:
        data = json.loads(state_path(run_dir, name).read_text(encoding="utf-8"))
        known = {f.name for f in dataclasses.fields(TrackerState)}
        return TrackerState(**{k: v for k, v in data.items() if k in known})
    except (OSError, ValueError, TypeError):
        return None


def write_state(run_dir: Path, name: str, state: TrackerState) -> None:
    path = state_path(run_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(dataclasses.asdict(state), indent=1, sort_keys=True) + "\n")
