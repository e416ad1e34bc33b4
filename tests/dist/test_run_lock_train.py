"""One writer per run dir, with real processes: a second training into a run dir that a running one holds stops on
every rank with the holder named (no hang), and leaves the first's lock and records alone."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.fault import run_lock
from tests.conftest import TESTS, kill_tree, read_jsonl, run_hpctrain

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

STEPS = 6


def start_training(run_dir: Path, hold_s: int) -> subprocess.Popen:
    """Two ranks; rank 0 sleeps ``hold_s`` in step 3 (its peer waits in the gradient all-reduce). Its own session:
    the test kills its process group."""
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
    # The first holds the run dir for as long as the test needs (far beyond the second's start on a loaded machine:
    # with a 60 s hold, a slow second start found the first finished and trained); it is killed at the end.
    first = start_training(tmp_path, hold_s=100_000)
    try:
        wait_for_step(tmp_path, 2, first, 150)
        holder = json.loads((tmp_path / "heartbeat" / "rank_0.json").read_text())  # the first's rank 0
        lock = json.loads((tmp_path / "run.lock").read_text())
        second = run_hpctrain(["train", "digits", "--nproc-per-node", "2", f"run.dir={tmp_path}",
                               f"train.max_steps={STEPS}", "log.plots=false", "log.tensorboard=false"], 240)
        assert first.poll() is None, "the first training must still be running while the second is refused"
        assert json.loads((tmp_path / "run.lock").read_text())["token"] == lock["token"]  # still the first's lock
    finally:
        kill_tree(first.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)  # its session: a worker re-parented before the list was taken
        first.communicate(timeout=60)
    assert second.returncode == 2, second.output  # a UserError on every rank, none left waiting
    assert f"in use by another training: pid {holder['pid']} on {holder['host']}" in second.stderr, second.output
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "train"]
    assert steps == [1, 2]  # the first's lines only (it hangs in step 3); the second wrote none


def test_a_training_that_lost_its_lock_stops_on_every_rank_without_saving(tmp_path: Path):
    """Rank 0 judged dead while alive (a frozen node): another training took the lock. At its next beat (BEAT_S) rank
    0 finds it, and the step vote stops both ranks with an error naming the new holder; no checkpoint after."""
    env = {**os.environ, "PYTHONPATH": str(TESTS), "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    first = subprocess.Popen(
        [sys.executable, "-m", "hpctrain", "train", "digits", "--nproc-per-node", "2", f"run.dir={tmp_path}",
         "train.max_steps=100000", "log.every_steps=1", "log.plots=false", "log.tensorboard=false",
         "ckpt.every_steps=100000", "eval.every_steps=0", "fault.hang_timeout_s=0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_step(tmp_path, 2, first, 150)
        # As another process that judged rank 0 dead takes over: under the guard (a plain write could land between
        # a beat's check and its rewrite, and be overwritten).
        path = tmp_path / "run.lock"
        thief = run_lock.Owner("node9", 1, "", job_id="777", token="thief")
        deadline = time.time() + 60
        while not run_lock._take_over(path, run_lock.read_owner(path), thief):
            assert time.time() < deadline, "could not take the lock over"
            time.sleep(0.05)
        out, err = first.communicate(timeout=200)  # the beat comes within 30 s
    finally:
        kill_tree(first.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 2, out + err
    assert err.count("lost its lock (now held by pid 1 on node9, Slurm job 777") >= 1, err
    assert "without saving" in err
    assert not list(tmp_path.glob("checkpoints/step_*"))
    assert json.loads((tmp_path / "run.lock").read_text())["token"] == "thief"  # the new holder's lock stays
