"""Reading back what the experiment trackers hold, for the dist and Slurm tiers: metrics.jsonl as a tracker should
hold it, an MLflow run's metric history, the records of a W&B offline run's .wandb file."""

from __future__ import annotations

import struct
from pathlib import Path

from hpctrain.metrics.records import read_metrics
from hpctrain.metrics.trackers.sink import tracker_values


def expected_history(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as the trackers should hold it: per key, step -> value (the last record of a step wins)."""
    out: dict[str, dict[int, float]] = {}
    for record in read_metrics(run_dir / "metrics.jsonl"):
        for key, value in tracker_values(record).items():
            out.setdefault(key, {})[record["step"]] = value
    return out


def the_mlflow_run(client, experiment: str):
    """The one run of ``experiment`` (an assertion that there is exactly one)."""
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0]


def mlflow_history(client, run) -> dict[str, list[tuple[int, float]]]:
    return {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
            for key in run.data.metrics}


def no_step_twice(history: dict[str, list[tuple[int, float]]]) -> None:
    for key, points in history.items():
        steps = [s for s, _ in points]
        assert len(steps) == len(set(steps)), f"{key}: a step twice: {sorted(steps)}"


def wandb_records(path: Path) -> list:
    """The records of a .wandb file (W&B's LevelDB-style log: a 7-byte header, 32 KiB blocks of chunks, each a
    CRC32C, a length and a type: FULL 1, FIRST 2, MIDDLE 3, LAST 4); a torn tail (a killed writer) ends the list."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # the block's zero padding
            pos += left
            continue
        if pos + 7 + length > len(data):
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            from wandb.proto.wandb_internal_pb2 import Record

            record = Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out
