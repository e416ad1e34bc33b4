"""Reading metrics.jsonl back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Records ordered by step. A resumed run logs again the steps after its last checkpoint; for each
    (split, step) the last record wins, which is the one of the run that went on. Torn lines of a killed
    writer are skipped."""
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "step" in record and "split" in record:
                latest[(record["split"], record["step"])] = record
    return sorted(latest.values(), key=lambda r: (r["step"], r["split"]))


RECORD_FIELDS = ("step", "split", "time", "epoch")

EVENTS = ("stop", "resume")
"""Splits that mark what happened to the run rather than measure it: a stop by a signal ('signal'), a resume
('checkpoint', 'world_size', 'saved_world_size'). In metrics.jsonl for the report; not on the console (the log
says it) nor in TensorBoard."""


def events(records: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """The records of one event split, by step."""
    return [r for r in records if r.get("split") == split]


def metric_values(record: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a record, without its bookkeeping fields (step, split, time, epoch)."""
    return {k: v for k, v in record.items() if k not in RECORD_FIELDS and isinstance(v, (int, float))}


def series(records: list[dict[str, Any]], split: str, key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if r["split"] == split and isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]
