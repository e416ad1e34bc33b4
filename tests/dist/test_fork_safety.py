"""Workers forked from a launcher that imported a user module doing parallel tensor work at import
(launcher/fork_safety: OpenMP is not fork-safe), and Ctrl-C on a worker stuck in C code."""

from __future__ import annotations

import os
import re
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


def test_an_openmp_team_a_plugin_started_before_hpctrain_sends_the_workers_to_exec(tmp_path: Path):
    """A sitecustomize (or .pth) plugin that runs a tensor op starts the launcher's OpenMP team before hpctrain can
    keep it from starting: forked workers hung at their first parallel op. They start as new Pythons instead, and
    the launcher says why."""
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "sitecustomize.py").write_text("import torch\n(torch.randn(4_000_000) * 2).sum()\n")
    path = os.pathsep.join(p for p in (str(plugin), str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    result = run_hpctrain(["train", EXPERIMENT, "--nproc-per-node", "2", f"run.dir={tmp_path / 'run'}",
                           "train.max_steps=2"], 150,
                          env={"OMP_NUM_THREADS": "2", "HPCTRAIN_WORKER_START": "auto", "PYTHONPATH": path})
    assert result.returncode == 0, result.output
    assert "the workers start as new Pythons" in result.stderr and "more than numpy's OpenBLAS keeps" in result.stderr, \
        result.stderr


def test_ctrl_c_twice_ends_a_run_whose_worker_is_stuck_in_c_code(tmp_path: Path):
    """Rank 0 blocks every signal and sleeps (as a worker stuck in C would: no Python handler runs): the first
    Ctrl-C waits for a step boundary that never comes, the second ends the run within INTERRUPT_GRACE_S, by the
    launcher's SIGKILL of the workers still running then (rank 0 at least), which the line says."""
    from hpctrain.launcher.signals import INTERRUPT_GRACE_S

    blocked = tmp_path / "rank0-blocked"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpctrain", "train", EXPERIMENT, "--nproc-per-node", "2", f"run.dir={tmp_path / 'run'}",
         "train.max_steps=1000", "log.every_steps=1"],
        env={**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "2", "HPCTRAIN_TEST_BLOCK_AT_STEP": "5",
             "HPCTRAIN_TEST_BLOCKED_FILE": str(blocked)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not blocked.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert blocked.exists(), f"rank 0 never reached the micro-step where it blocks:\n{_output(proc)}"
        proc.send_signal(signal.SIGINT)
        time.sleep(1.5)  # more than one press apart
        assert proc.poll() is None, _output(proc)  # the first press waits for a step boundary rank 0 never reaches
        pressed = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=INTERRUPT_GRACE_S + 30)
        waited = time.monotonic() - pressed
        output = proc.stdout.read()
        assert code == 130 and waited < INTERRUPT_GRACE_S + 15, (code, waited, output)
        killed = re.search(rf"hpctrain: interrupted \(Ctrl-C\): all 2 workers stopped; [12] still running "
                           rf"{INTERRUPT_GRACE_S} s after the second press were killed;", output)
        assert killed, output
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait(timeout=30)


def _output(proc: subprocess.Popen) -> str:
    """What the run printed so far (it is stopped first: its pipe then ends)."""
    if proc.poll() is None:
        kill_tree(proc.pid)
        proc.wait(timeout=30)
    return proc.stdout.read()
