"""The rendered job on a real two-node Slurm cluster (slurmctld + two slurmd in network namespaces).

Each job is submitted with `hpctrain slurm submit` and runs `digits` on 2 nodes x 2 gloo
processes. What is checked is what users lose days to: that both nodes really train, that
the result equals a local run, that preemption ends in a requeued job that finishes with the
same weights, and that a dead worker ends the job quickly with its host named. The srun launcher
(slurm.launcher=srun: one task per process, no torchrun) runs 2 nodes x 1 process: pre-flight, training,
and the preemption path."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import final_params, read_jsonl, run_hpctrain, same_params

pytestmark = pytest.mark.slurm

# rank 0 pauses 4 s inside step 16, so the preemption test can signal a job that is surely mid-run;
# a pause changes no number, and every run below has it.
PAUSE = "hang:rank=0:step=15:seconds=4"
COMMON = [
    "train.max_steps=40", "log.every_steps=5", "eval.every_steps=20", "data.num_workers=0",
    "slurm.nodes=2", "slurm.gpus_per_node=2", "slurm.gpus=false", "slurm.cpus_per_task=2",
    "slurm.monitor_every_s=1", "fault.heartbeat_every_s=1", f"slurm.env=['HPCTRAIN_FAULT={PAUSE}']",
]
HOSTILE_NAME = 'two nodes "digits" $(touch INJECTED)'


def submit(cluster, run_dir: Path, *overrides: str, cwd: Path) -> str:
    res = run_hpctrain(["slurm", "submit", "digits", f"run.dir={run_dir}", *COMMON, *overrides],
                       env={"SLURM_CONF": str(cluster.conf)}, cwd=cwd, timeout=60)
    assert res.returncode == 0, res.output
    return res.stdout.strip().splitlines()[-1]


def job_log(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*.out")))


def val_records(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time"}
            for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "val"]


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """One complete 2 x 2 job, shared by the tests that compare against it."""
    work = tmp_path_factory.mktemp("work")
    run_dir = work / "two-nodes"
    # MLflow on, in its default file store in the run dir (the nodes reach nothing else): the preempted job's
    # tracker run is compared with this one's
    job_id = submit(cluster, run_dir, f"slurm.job_name={HOSTILE_NAME}", 'log.trackers=["mlflow"]',
                    cwd=work)  # str values are taken as typed
    fields = cluster.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=150)
    assert fields["JobState"] == "COMPLETED", f"{fields}\n{job_log(run_dir)}"
    return run_dir, job_id, fields, work


def test_two_node_job_completes_on_both_hosts_and_equals_a_local_run(cluster, uninterrupted, tmp_path):
    run_dir, job_id, fields, work = uninterrupted
    assert fields["JobName"] == HOSTILE_NAME  # sbatch read the quoted name back exactly
    assert not (work / "INJECTED").exists()
    hosts = {json.loads(p.read_text())["host"] for p in (run_dir / "heartbeat").glob("rank_*.json")}
    assert hosts == {"node1", "node2"}
    assert "4 process(es) on 2 node(s)" in job_log(run_dir)
    # the node monitors ran on both nodes, the job's own statistics were saved
    assert {p.name for p in (run_dir / "monitor").glob("top_*.log")} == {"top_node1.log", "top_node2.log"}
    assert "%Cpu(s)" in (run_dir / "monitor" / "top_node2.log").read_text()
    assert (run_dir / "slurm" / f"launch_{job_id}.sh").exists()

    local = tmp_path / "local"
    overrides = [o for o in COMMON if not o.startswith(("slurm.", "fault."))]
    res = run_hpctrain(["train", "digits", "--nproc-per-node", "4", f"run.dir={local}", *overrides],
                       env={"HPCTRAIN_FAULT": PAUSE}, timeout=180)
    assert res.returncode == 0, res.output
    assert val_records(run_dir) == val_records(local)
    assert same_params(final_params(run_dir), final_params(local))


def test_preemption_signal_checkpoints_requeues_and_resumes_to_the_same_result(cluster, uninterrupted, tmp_path,
                                                                               monkeypatch):
    reference = uninterrupted[0]
    run_dir = tmp_path / "preempted"
    # With a loader worker per rank: srun passes the signal to every process of the step, workers and the
    # forkserver helper included, and none of them may die of it (a dead helper took the workers along).
    job_id = submit(cluster, run_dir, "data.num_workers=1", 'log.trackers=["mlflow","wandb"]', "log.wandb_offline=true",
                    cwd=tmp_path)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and any(r["step"] >= 15 for r in read_jsonl(metrics))):
        assert time.monotonic() < deadline, f"no progress: {cluster.job(job_id)}\n{job_log(run_dir)}"
        time.sleep(0.2)
    res = run_hpctrain(["slurm", "cancel", str(run_dir), "--signal=USR2"], env={"SLURM_CONF": str(cluster.conf)})
    assert res.returncode == 0, res.output

    fields = cluster.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=150)
    log = job_log(run_dir)
    assert fields["JobState"] == "COMPLETED", f"{fields}\n{log}"
    assert int(fields["Restarts"]) == 1
    assert "got SIGUSR2, passing it to the job step" in log
    assert "stopped by SIGUSR2" in log and "resumed from" in log
    assert "(restart 1)" in log  # --open-mode=append kept the first run's log above the second
    state = json.loads((run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
                        / "state.json").read_text())
    assert state["step"] == 40
    # Not bit-identical to the uninterrupted run with 4 ranks: DDP builds its gradient buckets in parameter order and
    # rebuilds them in gradient-ready order after a process's first step, so the first step after a resume
    # all-reduces at other offsets and gloo's ring adds 4 values in another order (last-bit rounding), which this
    # batch-norm model at lr 3e-3 amplifies over the remaining steps by an amount that depends on the step the
    # signal lands at (timing): stopped at step 17, params differ by up to 1% at step 40, as they did before issue 13.
    # So the exact comparison is with a local 4-process run stopped at the same step and resumed: the preemption
    # path (signal, requeue, Slurm relaunch) must add nothing to what a resume does.
    stopped_at = int(re.search(r"stopped by SIGUSR2 at step (\d+)", log).group(1))
    local = tmp_path / "local"
    overrides = [o for o in COMMON if not o.startswith(("slurm.", "fault."))] + ["data.num_workers=1"]
    for extra in ([f"train.stop_at_step={stopped_at}"], []):
        res = run_hpctrain(["train", "digits", "--nproc-per-node", "4", f"run.dir={local}", *overrides, *extra],
                           env={"HPCTRAIN_FAULT": PAUSE}, timeout=180)
        assert res.returncode == 0, res.output
    assert val_records(run_dir) == val_records(local)
    assert same_params(final_params(run_dir), final_params(local))
    ours, theirs = val_records(run_dir)[-1], val_records(reference)[-1]
    assert ours["step"] == theirs["step"] == 40 and ours["accuracy"] == theirs["accuracy"]
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-3)  # same run, up to the amplified rounding
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the runs' default file stores
    check_tracker_runs(cluster, run_dir, reference)


def check_tracker_runs(cluster, run_dir: Path, reference: Path) -> None:
    """The preempted and requeued job has one MLflow run whose history is its metrics.jsonl, with the steps and
    keys of the uninterrupted job's run (the values agree as the records do: up to the rounding explained above);
    its W&B offline run has one id, a part per launch, and `hpctrain slurm status` says how to upload it."""
    import mlflow

    from tests.tracker_history import expected_history, mlflow_history, no_step_twice, the_mlflow_run

    histories = []
    for run in (run_dir, reference):
        client = mlflow.tracking.MlflowClient(tracking_uri=(run / "trackers" / "mlruns").as_uri())
        tracked = the_mlflow_run(client, "digits")
        assert tracked.info.status == "FINISHED"
        history = mlflow_history(client, tracked)
        no_step_twice(history)
        assert {k: dict(v) for k, v in history.items()} == expected_history(run)
        histories.append({k: sorted(dict(v)) for k, v in history.items()})
    assert histories[0] == histories[1] and histories[0]["train/loss"] == list(range(5, 41, 5))
    run_id = json.loads((run_dir / "trackers" / "wandb.json").read_text())["run_id"]
    parts = sorted((run_dir / "trackers" / "wandb").glob("offline-run-*"))
    assert len(parts) == 2 and all(p.name.endswith(f"-{run_id}") for p in parts)  # before and after the requeue
    assert "upload it with: wandb sync --id" in job_log(run_dir)
    status = run_hpctrain(["slurm", "status", str(run_dir)], env={"SLURM_CONF": str(cluster.conf)})
    assert f"W&B offline run; upload it with: wandb sync --id {run_id}" in status.stdout, status.output


def test_killed_worker_fails_the_job_fast_and_names_its_host(cluster, tmp_path):
    run_dir = tmp_path / "killed"
    job_id = submit(cluster, run_dir, "train.max_steps=5000", cwd=tmp_path)
    beats: dict[int, dict] = {}
    deadline = time.monotonic() + 120
    while len(beats) < 4 or min(b["step"] for b in beats.values()) < 2:
        assert time.monotonic() < deadline, f"workers did not start: {cluster.job(job_id)}\n{job_log(run_dir)}"
        time.sleep(0.2)
        for p in (run_dir / "heartbeat").glob("rank_*.json"):
            try:
                beat = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            beats[beat["rank"]] = beat
    victim = next(b for b in beats.values() if b["host"] == "node2")
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.monotonic()
    fields = cluster.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=90)
    elapsed = time.monotonic() - killed
    log = job_log(run_dir)
    assert fields["JobState"] == "FAILED", f"{fields}\n{log}"
    assert elapsed < 45, f"the job took {elapsed:.0f} s to fail"
    assert f"worker rank {victim['rank']} " in log and f"pid {victim['pid']}, node2) failed first, killed by SIGKILL" in log


def test_doctor_runs_on_every_node_and_names_the_one_that_is_wrong(cluster):
    # hpctv1p exists in node1's namespace only: NCCL would fail on node2, and doctor says so there.
    import sys

    env = {**cluster.env, "NCCL_SOCKET_IFNAME": "hpctv1p", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(["srun", "--nodes=2", "--ntasks-per-node=1", sys.executable, "-m", "hpctrain", "doctor"],
                          env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert proc.returncode != 0
    assert "node1: PASS master address: node1 resolves to 10.77.0.11" in out
    assert "node2: PASS master address: node1 resolves to 10.77.0.11" in out
    assert "node1: PASS NCCL_SOCKET_IFNAME" in out and "node2: FAIL NCCL_SOCKET_IFNAME" in out


def test_preflight_runs_on_both_nodes_first_and_a_failure_stops_the_job(cluster, tmp_path):
    ok_dir, bad_dir = tmp_path / "preflight-ok", tmp_path / "preflight-bad"
    # 4 ranks share 2 cores here: stragglers are real (a CI run measured 1.89x), so that limit is lifted.
    small = "slurm.preflight_args=['--max-size', '256KiB', '--max-straggler', '1000']"
    ok = submit(cluster, ok_dir, "slurm.preflight=true", small, "train.max_steps=5", cwd=tmp_path)
    bad = submit(cluster, bad_dir, "slurm.preflight=true",
                 "slurm.preflight_args=['--max-size', '64KiB', '--min-busbw', '1000000']", cwd=tmp_path)
    assert cluster.wait_job(ok, ("COMPLETED", "FAILED", "CANCELLED"), timeout=150)["JobState"] == "COMPLETED", job_log(ok_dir)
    report = json.loads((ok_dir / "preflight" / ok / "preflight.json").read_text())
    assert report["world_size"] == 4 and {r["host"] for r in report["ranks"]} == {"node1", "node2"}
    assert report["bandwidth"][-1]["bytes"] == 256 * 1024
    assert (ok_dir / "metrics.jsonl").exists()
    assert cluster.wait_job(bad, ("COMPLETED", "FAILED", "CANCELLED"), timeout=150)["JobState"] == "FAILED"
    assert "the pre-flight failed, not training" in job_log(bad_dir)
    assert not (bad_dir / "metrics.jsonl").exists(), "training must not start after a failed pre-flight"


SRUN_MODE = ["slurm.launcher=srun", "slurm.nodes=2", "slurm.gpus_per_node=1", "slurm.gpus=false",
             "slurm.cpus_per_task=2", "slurm.monitor_every_s=1", "log.every_steps=5", "data.num_workers=0",
             "fault.heartbeat_every_s=1", "ckpt.every_minutes=30"]


def submit_srun_mode(cluster, run_dir: Path, *overrides: str) -> str:
    res = run_hpctrain(["slurm", "submit", "digits", f"run.dir={run_dir}", *SRUN_MODE, *overrides],
                       env={"SLURM_CONF": str(cluster.conf)}, cwd=run_dir.parent, timeout=60)
    assert res.returncode == 0, res.output
    return res.stdout.strip().splitlines()[-1]


def test_srun_launcher_job_trains_on_both_nodes_without_torchrun(cluster, tmp_path):
    """slurm.launcher=srun: Slurm starts the training processes itself (one task per process, here 2 nodes x 1
    on CPU nodes), they meet at the first node over tcp://, and each node's first task runs the monitors; the
    pre-flight runs the same way first."""
    run_dir = tmp_path / "srun-launcher"
    job_id = submit_srun_mode(cluster, run_dir, "train.max_steps=10", "eval.every_steps=10", "slurm.preflight=true",
                              "slurm.preflight_args=['--max-size', '64KiB', '--max-straggler', '1000']")
    fields = cluster.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=90)
    log = job_log(run_dir)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields}\n{log}"
    launch = (run_dir / "slurm" / f"launch_{job_id}.sh").read_text()
    assert "--ntasks-per-node=1" in launch and "hpctrain.slurm.task" in launch and "torchrun" not in launch
    report = json.loads((run_dir / "preflight" / job_id / "preflight.json").read_text())
    assert report["world_size"] == 2 and {r["host"] for r in report["ranks"]} == {"node1", "node2"}
    beats = [json.loads(p.read_text()) for p in (run_dir / "heartbeat").glob("rank_*.json")]
    assert {(b["rank"], b["host"]) for b in beats} == {(0, "node1"), (1, "node2")}
    assert "2 process(es) on 2 node(s)" in log
    assert {p.name for p in (run_dir / "monitor").glob("top_*.log")} == {"top_node1.log", "top_node2.log"}
    assert val_records(run_dir)[-1]["step"] == 10


def test_srun_launcher_preemption_signal_reaches_every_task_and_the_job_resumes(cluster, tmp_path):
    """The warning signal in srun mode: batch shell -> srun -> every task (no torchrun between), save, requeue."""
    run_dir = tmp_path / "srun-preempted"
    job_id = submit_srun_mode(cluster, run_dir, "train.max_steps=30", "eval.every_steps=30",
                              "slurm.env=['HPCTRAIN_FAULT=hang:rank=0:step=10:seconds=4']")
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while not (metrics.exists() and any(r["step"] >= 10 for r in read_jsonl(metrics))):
        assert time.monotonic() < deadline, f"no progress: {cluster.job(job_id)}\n{job_log(run_dir)}"
        time.sleep(0.2)
    res = run_hpctrain(["slurm", "cancel", str(run_dir), "--signal=USR2"], env={"SLURM_CONF": str(cluster.conf)})
    assert res.returncode == 0, res.output
    fields = cluster.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=120)
    log = job_log(run_dir)
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) == 1, f"{fields}\n{log}"
    assert "got SIGUSR2, passing it to the job step" in log
    assert "stopped by SIGUSR2" in log and "resumed from" in log
    assert val_records(run_dir)[-1]["step"] == 30


# ---- a sweep: one job array ------------------------------------------------------------------------------------

SWEEP = ["train.max_steps=30", "log.every_steps=5", "eval.every_steps=15", "data.num_workers=0", "slurm.nodes=1",
         "slurm.gpus_per_node=1", "slurm.gpus=false", "slurm.cpus_per_task=1", "slurm.monitor_every_s=0",
         "fault.heartbeat_every_s=1", f"slurm.env=['HPCTRAIN_FAULT={PAUSE}']"]
GRID = ["--grid", "optim.lr=1e-3,3e-3", "--grid", "train.micro_batch_size=25,50"]


def _running_tasks(cluster, array_id: str) -> list[int]:
    out = cluster.run("squeue", "--noheader", "--array", "--jobs", array_id, "--format=%i|%T").stdout
    return [int(i.split("_")[1]) for i, state in (line.split("|") for line in out.split()) if state == "RUNNING"
            and "[" not in i]


def test_a_sweep_array_runs_every_point_survives_a_preemption_and_equals_runs_made_alone(cluster, tmp_path):
    """4 points, at most 2 at once; one running point preempted with USR2 is requeued and resumes its own
    checkpoint; all finish; every point's validation metrics and weights equal `hpctrain train` of its config."""
    from hpctrain.sweep.spec import read_plan

    sweep, env = tmp_path / "sweep", {"SLURM_CONF": str(cluster.conf)}
    res = run_hpctrain(["sweep", "submit", "digits", *SWEEP, *GRID, "--max-parallel", "2", "--dir", str(sweep)],
                       env=env, cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.output
    array_id = res.stdout.strip().splitlines()[-1]
    points = read_plan(sweep).points
    # The victim is the last task to start: it carries the array's own job id, and `scontrol requeue ARRAY_ID`
    # would requeue every task of the array (hpctrain requeues ARRAY_TASK).
    deadline, victim, most = time.monotonic() + 150, len(points) - 1, 0
    while True:
        assert time.monotonic() < deadline, f"the last point did not get to step 10: {cluster.run('squeue').stdout}"
        running = _running_tasks(cluster, array_id)
        most = max(most, len(running))
        metrics = sweep / points[victim].name / "metrics.jsonl"
        if victim in running and metrics.exists() and any(r["step"] >= 10 for r in read_jsonl(metrics)):
            break
        time.sleep(0.2)
    assert cluster.job(f"{array_id}_{victim}")["JobId"] == array_id
    res = run_hpctrain(["slurm", "cancel", f"{array_id}_{victim}", "--signal=USR2"], env=env)
    assert res.returncode == 0, res.output
    for p in points:
        while (fields := cluster.job(f"{array_id}_{p.index}")).get("JobState") != "COMPLETED":
            assert fields.get("JobState") not in ("FAILED", "CANCELLED", "TIMEOUT"), fields
            assert time.monotonic() < deadline + 150, f"{p.name}: {fields}"
            most = max(most, len(_running_tasks(cluster, array_id)))
            time.sleep(0.5)
    assert most <= 2  # --max-parallel 2
    assert int(cluster.job(f"{array_id}_{victim}")["Restarts"]) == 1
    assert all(int(cluster.job(f"{array_id}_{p.index}")["Restarts"]) == 0 for p in points if p.index != victim)
    log = "".join(p.read_text() for p in (sweep / "logs").glob(f"*_{array_id}_{victim}.out"))
    assert "stopped by SIGUSR2" in log and "resumed from" in log and f"sweep point {points[victim].name}" in log
    status = run_hpctrain(["sweep", "status", str(sweep)], env=env)
    assert status.returncode == 0 and status.stdout.count("| done | 30 |") == 4, status.output
    assert "requeued 1 time(s)" in next(line for line in status.stdout.splitlines() if points[victim].name in line)
    report = run_hpctrain(["report", str(sweep)], env=env)
    assert report.returncode == 0 and "**best**" in report.stdout, report.output
    # Each point, the preempted one included, equals its config run alone with `hpctrain train`, bit for bit. With
    # the job's thread count: a task of one CPU runs with OMP_NUM_THREADS=1, and a run with 2 threads sums some
    # reductions in another order (seen: 0.51821734 vs 0.51821731 validation loss at micro 50).
    local = [o for o in SWEEP if not o.startswith(("slurm.", "fault."))]
    for p in points:
        alone = tmp_path / "alone" / p.name
        res = run_hpctrain(["train", "digits", f"run.dir={alone}", *local, *p.overrides],
                           env={"HPCTRAIN_FAULT": PAUSE, "OMP_NUM_THREADS": "1"}, timeout=180)
        assert res.returncode == 0, res.output
        assert val_records(sweep / p.name) == val_records(alone), p.name
        assert same_params(final_params(sweep / p.name), final_params(alone)), p.name
