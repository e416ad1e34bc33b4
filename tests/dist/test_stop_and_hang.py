"""A stop saves before anything else; a hang report tells frozen ranks from stuck ones; slow phases are not hangs.

Real processes (torchrun, gloo on CPU) with injected faults (hpctrain/fault/inject.py); hard timeouts."""

import json
import re
import time
from pathlib import Path

import pytest

from tests.conftest import read_jsonl
from tests.dist.test_fault import checkpoints, train

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def test_a_stop_at_an_eval_step_saves_first_and_skips_the_validation(tmp_path: Path):
    """The vote that carries the signal (sent inside step 9) is read at boundary 10, which is an eval step:
    validating first would spend Slurm's grace between SIGTERM and SIGKILL on something resuming does not need."""
    result = train(tmp_path, 2, "train.max_steps=30", "eval.every_steps=10", "data.num_workers=1",
                   fault="signal:rank=1:step=8", expect=75)
    assert "stopped by SIGTERM at step 10 with a checkpoint" in result.stderr
    assert "validation due at step 10 skipped: stopping (the resumed run catches up at step 10 first)" in result.stderr
    assert checkpoints(tmp_path) == ["step_00000010"]
    assert not [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "val"]
    assert any(r["split"] == "train" and r["step"] == 10 for r in read_jsonl(tmp_path / "metrics.jsonl"))

    resumed = train(tmp_path, 2, "train.max_steps=30", "eval.every_steps=10", "data.num_workers=1")
    # the skipped validation first, on the weights the stop saved: the records of an uninterrupted run
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "val"] == [10, 20, 30]
    assert "resumed from" in resumed.stderr and "step 10/30 | val" in resumed.stderr


def test_a_stop_at_the_last_step_saves_first_then_finishes_without_a_requeue(tmp_path: Path):
    """Requeueing a finished run would only restart it to say it is complete; its final validation must not be lost."""
    result = train(tmp_path, 2, "train.max_steps=10", "eval.every_steps=5", fault="signal:rank=1:step=8", expect=0)
    assert "stop signal at step 10, this launch's last: checkpoint saved, finishing normally" in result.stderr
    assert "stopped by" not in result.stderr and checkpoints(tmp_path) == ["step_00000010"]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "val"] == [5, 10]
    out = result.stderr
    assert out.index("saved checkpoint") < out.index("step 10/10 | val")


def test_a_frozen_rank_is_reported_as_frozen_with_its_stacks(tmp_path: Path):
    """Rank 1 sleeps inside a C call holding the interpreter lock (its watchdog thread cannot write either).
    Rank 0 waits in the all-reduce and reports it: not by its last file's phase as if current, but as frozen."""
    result = train(tmp_path, 2, "train.max_steps=50", "fault.hang_timeout_s=8", "fault.heartbeat_every_s=1",
                   "dist.timeout_s=20", fault="freeze:rank=1:step=3:seconds=30", expect=1, timeout=200)
    report = json.loads((tmp_path / "heartbeat" / "hang_report.json").read_text())
    by_rank = {b["rank"]: b for b in report["stuck"]}
    assert by_rank[1]["frozen"] and not by_rank[0]["frozen"], report
    assert re.search(r"rank 1 on \S+ \(pid \d+\): process frozen or stopped \(heartbeat not written for \d+ s\)",
                     result.stderr), result.stderr
    stacks = (tmp_path / "heartbeat" / "frozen_rank_1.txt").read_text()
    assert "inject.py" in stacks and "_fire" in stacks  # written by faulthandler while the lock was held
    assert not (tmp_path / "heartbeat" / "frozen_rank_0.txt").exists()  # alive and stuck: its own report
    assert "All threads" in (tmp_path / "heartbeat" / "stuck_rank_0.txt").read_text()


def test_slow_warm_up_and_long_validation_are_not_hangs(tmp_path: Path):
    """Each rank's first forward takes 6 s (torch.compile does that), and validation takes about 12 s in
    0.3 s batches: both longer than fault.hang_timeout_s=4, neither is a hang."""
    slow = ";".join(f"hang:rank={r}:step=0:seconds=6;slow:rank={r}:step=6:phase=eval:seconds=0.3" for r in (0, 1))
    started = time.monotonic()
    result = train(tmp_path, 2, "train.max_steps=6", "eval.micro_batch_size=5", "fault.hang_timeout_s=4",
                   "fault.heartbeat_every_s=1", "fault.slow_phase_timeout_s=60", fault=slow)
    assert time.monotonic() - started > 6 + 10  # the slow parts did happen
    assert "no progress" not in result.stderr and not (tmp_path / "heartbeat" / "hang_report.json").exists()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "val"] == [6]
