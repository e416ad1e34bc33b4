"""How a script job's ranks ended, node by node: RUN_DIR/slurm/exits/JOB.RESTART/nodeN.json.

Each node's launcher (launcher/torchrun.py) writes one record when its torchrun ends: the node's exit code (that of
the rank that failed first, a requeue code when every rank asked for one, or 0), and for a failure that rank, its
host and its last error line. The job's batch shell reads the exit codes to decide whether to requeue (every node
asked for it: slurm/render.py); `hpctrain slurm status` and `sweep status` read the failure. JOB is what
`scontrol requeue` takes (the job id, or ARRAY_TASK for a sweep's point); RESTART is SLURM_RESTART_COUNT, so a
requeued job's records stand apart from its first run's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from hpctrain.atomic import atomic_write_text

EXITS = "slurm/exits"
"""Under the run dir: one folder per job and restart."""
RECORD_GLOB = "node*.json"
"""The records in one folder (the batch shell counts them against the job's nodes)."""
_FOLDER = re.compile(r"^(?P<job>[\w]+)\.(?P<restart>\d+)$")


def record_path(exits_dir: str | Path, node_id: int) -> Path:
    return Path(exits_dir) / f"node{node_id}.json"


def write_record(exits_dir: str | Path, node_id: int, record: dict) -> None:
    """The node's record, whole or not at all. ``exit_code`` is written first: the batch shell reads it with sed."""
    ordered = {"exit_code": record["exit_code"], **record}
    Path(exits_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(record_path(exits_dir, node_id), json.dumps(ordered) + "\n")


def latest_records(run_dir: Path, job: str) -> list[dict]:
    """The records of the job's latest run (its highest restart) that has any; [] when none was written (an
    experiment's job, or a job that has not ended)."""
    folders = []
    for folder in (run_dir / EXITS).glob(f"{job}.*"):
        m = _FOLDER.match(folder.name)
        if m and m.group("job") == job:
            folders.append((int(m.group("restart")), folder))
    for _, folder in sorted(folders, reverse=True):
        records = []
        for path in sorted(folder.glob(RECORD_GLOB)):
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError):  # written atomically: unreadable means gone meanwhile
                continue
        if records:
            return records
    return []


def first_failure(records: list[dict]) -> dict | None:
    """The failure that caused the others: not evidently a consequence of another rank's (a peer gone, torchrun's
    SIGTERM), then the earliest; None when no node failed."""
    failed = [r for r in records if r.get("outcome") == "failed"]
    if not failed:
        return None
    return min(failed, key=lambda r: (bool(r.get("consequence")), r.get("time", 0.0), r.get("rank", 0)))


def failure_line(records: list[dict]) -> str:
    """'failed: rank R (local rank L) on HOST, HOW: ERROR' for the first failure ('failed: on HOST, its launcher
    ...' when no rank failed but the node's torchrun), '' when none."""
    first = first_failure(records)
    if first is None:
        return ""
    error = first.get("error", "")
    who = f"rank {first['rank']} (local rank {first.get('local_rank', '?')}) " if "rank" in first else ""
    return (f"failed: {who}on {first.get('host', '?')}, {first.get('how', 'exit code ' + str(first['exit_code']))}"
            + (f": {error}" if error else ""))
