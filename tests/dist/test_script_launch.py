"""`hpctrain train --script`: a plain torch DDP script (tests/plain_ddp.py, nothing of hpctrain in it) on 2 gloo
processes here, as it runs on Slurm: its arguments passed through untouched, HPCTRAIN_SETTINGS in every rank, a
SIGTERM to the launcher reaching each rank once and its exit 75 reported as a stop to resume (not a failure), and a
rank that raises named with its own error line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import pytest

from tests.conftest import TESTS, kill_tree, run_hpctrain

pytestmark = [pytest.mark.dist, pytest.mark.timeout(200)]


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "train.py"
    shutil.copy(TESTS / "plain_ddp.py", path)
    return path


def ranks(out: Path) -> dict[int, dict]:
    return {r["rank"]: r for r in (json.loads(p.read_text()) for p in (out / "ranks").glob("*.json"))}


def test_a_plain_script_runs_on_two_processes_with_its_arguments_and_the_settings(script, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "own"
    res = run_hpctrain(["train", str(script), "--nproc-per-node", "2", f"run.dir={run_dir}", "run.seed=7",
                        "--", "--out", str(out), "--epochs", "2", "--metrics", str(run_dir / "metrics.jsonl")],
                       cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.output
    seen = ranks(out)
    assert sorted(seen) == [0, 1] and {r["world"] for r in seen.values()} == {2}
    assert seen[1]["argv"] == ["--out", str(out), "--epochs", "2", "--metrics", str(run_dir / "metrics.jsonl")]
    settings = run_dir / "settings.toml"
    assert {r["settings"] for r in seen.values()} == {str(settings.resolve())}
    assert tomllib.loads(settings.read_text()) == {"experiment": f"script:{script}",  # only what was given
                                                   "run": {"dir": str(run_dir.resolve()), "seed": 7}}
    assert (out / "final.pt").exists() and "failed" not in res.stderr
    report = run_hpctrain(["report", str(run_dir)])
    assert report.returncode == 0 and "optimizer steps logged: 2" in report.stdout, report.output


def test_sigterm_reaches_each_rank_once_and_exit_75_is_a_stop_to_resume(script, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "own"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain", "train", "--script", str(script), "--nproc-per-node",
                             "2", f"run.dir={run_dir}", "--", "--out", str(out), "--handle-signal", "--step-sleep",
                             "0.2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (out / "progress.txt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=90)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 75, output
    assert "all 2 workers of the script exited with a requeue code (75): a stop it asked to be resumed from" in output
    assert "failed first" not in output and "failed (exitcode" not in output
    received = {p.name: p.read_text().splitlines() for p in (out / "signals").glob("*.txt")}
    assert sorted(received) == ["rank0.txt", "rank1.txt"]
    assert all(len(lines) == 1 and lines[0].startswith("SIGTERM ") for lines in received.values()), received
    # the same command resumes from the script's own checkpoint
    res = run_hpctrain(["train", "--script", str(script), "--nproc-per-node", "2", f"run.dir={run_dir}", "--",
                        "--out", str(out), "--epochs", "1"], cwd=tmp_path, timeout=120)
    assert res.returncode == 0 and "resumed from" in res.stdout, res.output


def test_a_rank_that_raises_is_named_with_its_own_error_line(script, tmp_path):
    res = run_hpctrain(["train", "--script", str(script), "--nproc-per-node", "2", f"run.dir={tmp_path / 'run'}",
                        "--", "--out", str(tmp_path / "own"), "--fail-rank", "1"], cwd=tmp_path, timeout=120)
    assert res.returncode == 1, res.output
    assert "hpctrain: worker rank 1 (local rank 1, " in res.stderr
    # exit code 1, or (seen) an abort as it exits, a torch thread still running at the end of the interpreter
    failed = next(line for line in res.stderr.splitlines() if "failed first" in line)
    assert ("exit code 1: " in failed or "killed by SIGABRT: " in failed) and \
        "RuntimeError: boom on rank 1" in failed, res.stderr
