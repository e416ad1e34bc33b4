"""A torchrun script that hpctrain did not write, on the real two-node cluster (issue 41).

The script (tests/plain_ddp.py, copied into the test's folder) is plain torch: init_process_group from torchrun's
variables, a DistributedSampler, DDP, its own torch.save checkpoint every epoch, and (with --handle-signal) a
handler of its own that saves and exits 75. What is checked: 2 nodes x 2 processes run it on both hosts; a USR2
reaches every rank once, the job is requeued once and resumes from the script's checkpoint to the same weights as
an uninterrupted run; a rank that raises fails the job within seconds, not requeued, and `slurm status` names the
rank, its host and its error; a sweep over a script argument is one array, with its status and report.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import TESTS, run_hpctrain
from tests.slurm.test_cluster import job_log

pytestmark = pytest.mark.slurm

SHAPE = ["slurm.nodes=2", "slurm.gpus=false", "slurm.cpus_per_task=2", "slurm.monitor_every_s=1",
         "slurm.time=00:10:00"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The folder jobs are submitted from, holding the user's script."""
    folder = tmp_path_factory.mktemp("scripts")
    shutil.copy(TESTS / "plain_ddp.py", folder / "train.py")
    return folder


def submit(cluster, work: Path, run_dir: Path, *script_args: str) -> str:
    res = run_hpctrain(["slurm", "submit", "--script", "train.py", "--nproc-per-node", "2", f"run.dir={run_dir}",
                        *SHAPE, "--", "--out", str(run_dir / "own"), *script_args],
                       env={"SLURM_CONF": str(cluster.conf)}, cwd=work, timeout=60)
    assert res.returncode == 0, res.output
    return res.stdout.strip().splitlines()[-1]


def ranks(run_dir: Path) -> dict[int, dict]:
    return {r["rank"]: r for r in (json.loads(p.read_text()) for p in (run_dir / "own" / "ranks").glob("*.json"))}


@pytest.fixture(scope="module")
def uninterrupted(cluster, work):
    """The script run through, 2 nodes x 2 processes (its signal handler never called): shared by the tests."""
    run_dir = work / "through"
    job_id = submit(cluster, work, run_dir, "--handle-signal", "--metrics", str(run_dir / "metrics.jsonl"))
    fields = cluster.wait_job(job_id, ENDED, timeout=120)
    assert fields["JobState"] == "COMPLETED", f"{fields}\n{job_log(run_dir)}"
    return run_dir, job_id


def test_a_plain_ddp_script_runs_on_two_nodes_and_its_run_dir_reports(cluster, uninterrupted):
    run_dir, job_id = uninterrupted
    seen = ranks(run_dir)
    assert sorted(seen) == [0, 1, 2, 3] and {r["world"] for r in seen.values()} == {4}
    assert {r["host"] for r in seen.values()} == {"node1", "node2"}
    settings = run_dir / "settings.toml"
    assert {r["settings"] for r in seen.values()} == {str(settings.resolve())}
    assert 'experiment = "script:train.py"' in settings.read_text() and "[slurm]" in settings.read_text()
    assert "[train]" not in settings.read_text()  # only what was given, none of hpctrain's defaults
    assert {p.name for p in (run_dir / "monitor").glob("top_*.log")} == {"top_node1.log", "top_node2.log"}
    env = {"SLURM_CONF": str(cluster.conf)}
    status = run_hpctrain(["slurm", "status", str(run_dir)], env=env)
    assert status.returncode == 0 and f"job {job_id}: COMPLETED" in status.stdout, status.output
    assert "failed:" not in status.stdout
    report = run_hpctrain(["report", str(run_dir)], env=env)
    assert report.returncode == 0, report.output
    assert (run_dir / "report" / "overview.png").exists() and "node1" in report.stdout


def test_usr2_reaches_every_rank_once_and_the_script_resumes_to_the_same_weights(cluster, work, uninterrupted):
    run_dir = work / "preempted"
    job_id = submit(cluster, work, run_dir, "--handle-signal", "--step-sleep", "0.15")
    deadline = time.monotonic() + 90
    while not (run_dir / "own" / "progress.txt").exists():
        assert time.monotonic() < deadline, f"no progress: {cluster.job(job_id)}\n{job_log(run_dir)}"
        time.sleep(0.2)
    res = run_hpctrain(["slurm", "cancel", str(run_dir), "--signal=USR2"], env={"SLURM_CONF": str(cluster.conf)})
    assert res.returncode == 0, res.output
    fields = cluster.wait_job(job_id, ENDED, timeout=150)
    log = job_log(run_dir)
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) == 1, f"{fields}\n{log}"
    # each of the 4 ranks got the signal exactly once (Slurm delivers it to every process; nobody passes it twice)
    signals = {p.name: p.read_text().splitlines() for p in (run_dir / "own" / "signals").glob("rank*.txt")}
    assert sorted(signals) == [f"rank{r}.txt" for r in range(4)], log
    assert all(len(lines) == 1 and lines[0].startswith("SIGUSR2 ") for lines in signals.values()), signals
    assert {line.split()[1] for lines in signals.values() for line in lines} == {"node1", "node2"}
    assert log.count("requeueing job") == 1 and "resumed from" in log
    assert all(r["restart"] == "1" for r in ranks(run_dir).values())  # the records are the second run's
    ours = torch.load(run_dir / "own" / "final.pt")
    theirs = torch.load(uninterrupted[0] / "own" / "final.pt")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_rank_that_raises_fails_the_job_fast_not_requeued_and_status_names_it(cluster, work):
    run_dir = work / "raises"
    job_id = submit(cluster, work, run_dir, "--fail-rank", "1", "--epochs", "50")
    cluster.wait_job(job_id, ("RUNNING",) + ENDED, timeout=60)
    started = time.monotonic()
    fields = cluster.wait_job(job_id, ENDED, timeout=90)
    log = job_log(run_dir)
    assert fields["JobState"] == "FAILED" and int(fields.get("Restarts", 0)) == 0, f"{fields}\n{log}"
    assert time.monotonic() - started < 45, log
    host = ranks(run_dir)[1]["host"]
    status = run_hpctrain(["slurm", "status", str(run_dir)], env={"SLURM_CONF": str(cluster.conf)})
    assert status.returncode == 0, status.output
    failed = next((line for line in status.stdout.splitlines() if line.startswith("failed: ")), status.stdout + log)
    # exit code 1, or an abort as it exits (a torch thread still running at the end of the interpreter)
    assert failed.startswith(f"failed: rank 1 (local rank 1) on {host}, ") and \
        failed.endswith(": RuntimeError: boom on rank 1"), status.stdout + log
    assert "requeueing" not in log


def test_a_sweep_over_a_script_argument_is_one_array_with_status_and_report(cluster, work):
    sweep, env = work / "sweep", {"SLURM_CONF": str(cluster.conf)}
    res = run_hpctrain(["sweep", "submit", "--script", "train.py", "--nproc-per-node", "2", "--dir", str(sweep),
                        *[s for s in SHAPE if not s.startswith("slurm.nodes")], "slurm.nodes=1",
                        "--grid", "lr=0.02,0.05", "--metric-line", r"loss=([0-9.]+)",
                        "--", "--out", "{run_dir}/own", "--epochs", "2"], env=env, cwd=work, timeout=60)
    assert res.returncode == 0, res.output
    array_id = res.stdout.strip().splitlines()[-1]
    deadline = time.monotonic() + 120
    for index in (0, 1):
        while (state := cluster.job(f"{array_id}_{index}").get("JobState")) not in ENDED:
            assert time.monotonic() < deadline, f"point {index}: {state}"
            time.sleep(0.5)
        assert state == "COMPLETED", "".join(p.read_text() for p in (sweep / "logs").glob("*.out"))
    points = sorted(p for p in sweep.iterdir() if p.name.startswith("p00"))
    assert [json.loads((p / "own" / "ranks" / "rank0.json").read_text())["argv"][-2:] for p in points] == \
        [["--lr", "0.02"], ["--lr", "0.05"]]
    status = run_hpctrain(["sweep", "status", str(sweep)], env=env)
    assert status.returncode == 0 and status.stdout.count("| done | 2 | loss ") == 2, status.output
    report = run_hpctrain(["report", str(sweep)], env=env)
    assert report.returncode == 0 and "**best**" in report.stdout, report.output


def test_a_loop_under_hpctrain_session_is_preempted_requeued_and_resumes_as_uninterrupted(cluster, work, tmp_path):
    """Issue 40, level 3 on Slurm: tests/gan_loop.py submitted as a script on 2 nodes x 1 process; a preemption
    signal reaching rank 1 (HPCTRAIN_FAULT) stops both at one step with a checkpoint and exit 75, the job's launcher
    requeues it once, and the resumed loop's losses equal an uninterrupted local run's."""
    for name in ("gan_loop.py", "gan_experiment.py"):
        shutil.copy(TESTS / name, work / name)
    run_dir, env = work / "session", {"SLURM_CONF": str(cluster.conf)}
    fault = "slurm.env=[\"HPCTRAIN_FAULT=signal:rank=1:step=3:signal=SIGUSR2\"]"
    res = run_hpctrain(["slurm", "submit", "--script", "gan_loop.py", "--nproc-per-node", "1", f"run.dir={run_dir}",
                        *SHAPE, fault], env=env, cwd=work, timeout=60)
    assert res.returncode == 0, res.output
    fields = cluster.wait_job(res.stdout.strip().splitlines()[-1], ENDED, timeout=180)
    log = job_log(run_dir)
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) == 1, f"{fields}\n{log}"
    assert "stopped by SIGUSR2 at step 5 with a checkpoint" in log and "resumed from" in log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "stop"] == [5]
    local = run_hpctrain(["train", "gan_loop.py", "--nproc-per-node", "2", f"run.dir={tmp_path / 'local'}"],
                         cwd=work, timeout=120)
    assert local.returncode == 0, local.output

    def losses(folder: Path) -> dict:
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r["loss_d"], r["loss_g"]) for r in rows if r["split"] == "train"}

    assert losses(run_dir) == losses(tmp_path / "local") and sorted(losses(run_dir)) == list(range(1, 13))
