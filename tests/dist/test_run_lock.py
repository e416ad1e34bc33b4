"""One writer per run dir, with real processes: a second training into a run dir that a running one holds stops on
every rank with the holder named (no hang), and the first trains on unharmed."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TESTS, kill_tree, read_jsonl, run_hpctrain

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

STEPS = 6


def start_training(run_dir: Path, hold_s: int) -> subprocess.Popen:
    """Two ranks; rank 0 sleeps ``hold_s`` in step 3 (its peer waits in the gradient all-reduce)."""
    env = {**os.environ, "PYTHONPATH": str(TESTS), "PYTHONUNBUFFERED": "1",
           "HPCTRAIN_FAULT": f"hang:rank=0:step=2:seconds={hold_s}"}
    env.pop("RANK", None)
    return subprocess.Popen(
        [sys.executable, "-m", "hpctrain", "train", "digits", "--nproc-per-node", "2", f"run.dir={run_dir}",
         f"train.max_steps={STEPS}", "log.every_steps=1", "log.plots=false", "log.tensorboard=false",
         "fault.hang_timeout_s=0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_step(run_dir: Path, step: int, first: subprocess.Popen, timeout: float) -> None:
    beat = run_dir / "heartbeat" / "rank_0.json"
    deadline = time.time() + timeout
    while time.time() < deadline and first.poll() is None:
        try:
            if json.loads(beat.read_text())["step"] >= step:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    pytest.fail(f"the first training did not reach step {step} (exit code {first.poll()})")


def test_a_second_training_into_a_held_run_dir_is_refused_and_the_first_goes_on(tmp_path: Path):
    first = start_training(tmp_path, hold_s=60)
    try:
        wait_for_step(tmp_path, 2, first, 150)
        holder = json.loads((tmp_path / "heartbeat" / "rank_0.json").read_text())  # the first's rank 0
        second = run_hpctrain(["train", "digits", "--nproc-per-node", "2", f"run.dir={tmp_path}",
                               f"train.max_steps={STEPS}", "log.plots=false", "log.tensorboard=false"], 120)
        assert first.poll() is None, "the first training must still be running while the second is refused"
        out, err = first.communicate(timeout=150)
    finally:
        kill_tree(first.pid)
    assert second.returncode == 2, second.output  # a UserError on every rank, none left waiting
    assert f"in use by another training: pid {holder['pid']} on {holder['host']}" in second.stderr, second.output
    assert first.returncode == 0, out + err
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "train"]
    assert steps == list(range(1, STEPS + 1))  # the first's lines only, once each
    assert not (tmp_path / "run.lock").exists()  # released at the end
