"""A run that diverges (a learning rate far too high) on 2 CPU processes: its non-finite steps are skipped and listed,
and when more than train.max_skipped_steps come in a row every rank stops at the same step with the reason, also
when a stop and a resume fall inside that run of skips (the checkpoint holds the count). Hard timeouts."""

from pathlib import Path

import pytest

from tests.conftest import read_jsonl, run_hpctrain

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

LIMIT = 4
DIVERGING = ["model.width=8", "model.norm=group", "train.global_batch_size=40", "train.micro_batch_size=10",
             "log.every_steps=1", "log.plots=false", "log.tensorboard=false", "optim.lr=1e8", "optim.warmup_steps=0",
             "train.max_steps=40", f"train.max_skipped_steps={LIMIT}", "eval.every_steps=100"]


def train(run_dir: Path, *extra: str):
    return run_hpctrain(["train", "digits", f"run.dir={run_dir}", "--nproc-per-node=2", *DIVERGING, *extra], 180)


def test_a_diverged_run_skips_lists_and_stops_on_every_rank_across_a_resume(tmp_path: Path):
    first = train(tmp_path, "train.stop_at_step=4")
    assert first.returncode == 0, first.output
    skipped = [s for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "train" for s in r.get("skipped_at", [])]
    start = skipped[0] if skipped else 0
    # The stop fell inside the run of skips: steps start..4, fewer than the limit.
    assert 1 <= start <= 4 and skipped == list(range(start, 5)), first.output
    second = train(tmp_path)
    assert second.returncode != 0, second.output
    last = start + LIMIT
    # Counted on from the checkpoint: the uninterrupted run's step, not LIMIT + 1 steps after the resume.
    assert f"{LIMIT + 1} optimizer steps in a row (steps {start}-{last}) had a non-finite gradient" in second.output
    assert f"more than train.max_skipped_steps={LIMIT}" in second.output and "optim.lr" in second.output
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "train"]
    assert max(r["step"] for r in records) < last  # stopped there, on both ranks (no hang: the hard timeout)
