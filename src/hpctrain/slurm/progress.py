"""A run's training progress as its run dir shows it (metrics.jsonl, checkpoints/latest): the line `hpctrain slurm
status` prints below the job's state, and the latest step `hpctrain sweep status` shows per point."""

from __future__ import annotations

from pathlib import Path

from hpctrain.metrics.records import metric_values, read_metrics


def progress_line(run_dir: Path, script: bool = False) -> str:
    """Training progress from the run dir: last step, loss, validation metrics, newest checkpoint. ``script``: a
    script job's run dir, whose metrics.jsonl the script may or may not write, and whose checkpoints are its own."""
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.exists() else []
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    latest = run_dir / "checkpoints" / "latest"
    parts = [f"run {run_dir}:"]
    step = latest_step(records)
    if train:
        at = f" at step {train[-1]['step']}" if train[-1]["step"] != step else ""
        parts.append(f"step {step}, train loss {train[-1].get('loss', float('nan')):.4g}{at}")
    elif script and not records:
        parts.append("no metrics logged (the script writes none to metrics.jsonl, or has not yet)")
    else:
        parts.append("no training step logged yet" if step is None else f"step {step}, no train record yet")
    if val:
        parts.append(f"val at step {val[-1]['step']}: "
                     + ", ".join(f"{k} {v:.4g}" for k, v in metric_values(val[-1]).items()))
    if latest.exists() or not script:
        parts.append(f"checkpoint {latest.read_text().strip()}" if latest.exists() else "no checkpoint yet")
    return " ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if len(parts) > 2 else "")


def latest_step(records: list[dict]) -> int | None:
    """The run's latest step: that of its newest train, stop or resume record (a stop writes no train record, so
    that log windows stay aligned across the resume: the last train record may be steps behind)."""
    steps = [r["step"] for r in records if r.get("split") in ("train", "stop", "resume")]
    return steps[-1] if steps else None
