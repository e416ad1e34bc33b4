"""Workers forked from a launcher that imported a user module doing parallel tensor work at import
(dist/forked_workers: OpenMP is not fork-safe), and Ctrl-C on a worker stuck in C code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TESTS, kill_tree, run_hpctrain

pytestmark = [pytest.mark.dist, pytest.mark.timeout(200)]

EXPERIMENT = "omp_import_experiment:OmpAtImport"


def test_parallel_work_at_the_user_modules_import_does_not_hang_forked_workers(tmp_path: Path):
    """OMP_NUM_THREADS=2 (the job script exports it): the launcher's OpenMP team must not exist when it forks, and
    each worker still runs its ops on 2 threads (the experiment checks)."""
    result = run_hpctrain(["train", EXPERIMENT, "--nproc-per-node", "2", f"run.dir={tmp_path}"], 90,
                          env={"OMP_NUM_THREADS": "2", "HPCTRAIN_WORKER_START": "auto"})
    assert result.returncode == 0, result.output
    assert "new Pythons" not in result.stderr, result.stderr  # forked, not the exec fallback
    assert (tmp_path / "checkpoints" / "latest").exists()


def test_ctrl_c_twice_ends_a_run_whose_worker_is_stuck_in_c_code(tmp_path: Path):
    """Rank 0 blocks every signal and sleeps (as a worker stuck in C would: no Python handler runs): the first
    Ctrl-C waits for a step boundary that never comes, the second ends the run within INTERRUPT_GRACE_S."""
    from hpctrain.launch import INTERRUPT_GRACE_S

    proc = subprocess.Popen(
        [sys.executable, "-m", "hpctrain", "train", EXPERIMENT, "--nproc-per-node", "2", f"run.dir={tmp_path}",
         "train.max_steps=1000", "log.every_steps=1"],
        env={**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "2", "HPCTRAIN_TEST_BLOCK_AT_STEP": "5"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "metrics.jsonl").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(2.0)  # rank 0 is stuck by now (micro-step 5 is in its first steps)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.5)  # more than one press apart
        assert proc.poll() is None, proc.stdout.read()
        pressed = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=INTERRUPT_GRACE_S + 20)
        waited = time.monotonic() - pressed
        output = proc.stdout.read()
        assert code == 130 and waited < INTERRUPT_GRACE_S + 10, (code, waited, output)
        assert "hpctrain: interrupted (Ctrl-C): all 2 workers stopped" in output, output
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait(timeout=30)
