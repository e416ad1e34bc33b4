"""Sweeps (hpctrain.sweep): the grid, every point checked before anything is written, the array script (golden),
the lint against MaxArraySize, Slurm's view of an array parsed, the report's table (golden), and a --local sweep of
the toy experiment end to end: a failed point listed with its error, a finished one equal to the same config run
alone with `hpctrain train`. The array on a real two-node Slurm cluster: the last test of
tests/slurm/test_cluster.py."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from hpctrain.errors import UserError
from hpctrain.slurm import job, lint
from hpctrain.slurm.facts import Facts
from hpctrain.slurm.render import render_script
from hpctrain.commands import sweep as commands
from hpctrain.sweep import array, status
from hpctrain.sweep.grid import Axis, MAX_POINTS, grid_points, parse_axis
from hpctrain.sweep.spec import build_sweep, read_plan, write_sweep
from hpctrain.sweep.report import PointResult, point_results, sweep_table
from tests.conftest import kill_tree, read_jsonl, run_hpctrain

GOLDEN = Path(__file__).parent / "golden"
TOY = "toy_experiment:LinearToy"


# ---- the grid ----------------------------------------------------------------------------------------------------

def test_axes_read_lists_and_quotes_as_one_value_and_refuse_what_a_sweep_cannot_vary():
    assert parse_axis("optim.lr=1e-4, 2e-4,4e-4") == Axis("optim.lr", ("1e-4", "2e-4", "4e-4"))
    assert parse_axis("model.ch_mult=[1, 2],[1,2,2]").values == ("[1, 2]", "[1,2,2]")
    assert parse_axis("model.name='a,b',c").values == ("'a,b'", "c")
    for bad, words in (("optim.lr", "expected KEY=VALUE1"), ("optim.lr=1e-4,,2e-4", "empty value"),
                       ("optim.lr=1,1", "repeated"), ("run.dir=a,b", "does not vary run.dir"),
                       ("slurm.nodes=1,2", "one job script"),
                       ("fault.warning_signal=SIGUSR1,SIGHUP", "one job script")):
        with pytest.raises(UserError, match=words):
            parse_axis(bad)
    assert parse_axis("run.seed=0,1,2").values == ("0", "1", "2")  # seeds are a fine axis


def test_points_are_every_combination_first_axis_slowest_with_readable_names():
    points = grid_points([Axis("optim.lr", ("1e-4", "2e-4")), Axis("train.micro_batch_size", ("32", "64"))])
    assert [p.name for p in points] == ["p000_lr=1e-4_micro_batch_size=32", "p001_lr=1e-4_micro_batch_size=64",
                                        "p002_lr=2e-4_micro_batch_size=32", "p003_lr=2e-4_micro_batch_size=64"]
    assert points[2].overrides == ("optim.lr=2e-4", "train.micro_batch_size=32")
    clash = grid_points([Axis("a.x", ("-1",)), Axis("b.x", ("[1, 2]",))])
    assert clash[0].name == "p000_a.x=-1_b.x=1-2"  # the whole key where last parts clash; values made file-safe
    long = grid_points([Axis(f"k.a{i}", ("x" * 40,)) for i in range(5)])[0].name
    assert len(long) == 120 and long.startswith("p000_a0=xxx")  # cut, with a hash: under any file-name limit


def test_a_grid_above_the_limit_is_refused_unless_asked_for():
    axes = [Axis("a.x", tuple(map(str, range(40)))), Axis("b.y", tuple(map(str, range(26))))]
    with pytest.raises(UserError, match=f"1,040 points \\(over {MAX_POINTS:,}\\)") as err:
        grid_points(axes)
    assert "--allow-large" in err.value.hint
    assert len(grid_points(axes, allow_large=True)) == 1040
    with pytest.raises(UserError, match="twice"):
        grid_points([Axis("a.x", ("1",)), Axis("a.x", ("2",))])


# ---- every point checked ---------------------------------------------------------------------------------------

def test_a_bad_value_names_its_point_and_key_and_an_unknown_key_gets_a_hint(tmp_path):
    with pytest.raises(UserError, match=r"sweep point p001_lr=fast \(optim.lr=fast\): .*optim.lr"):
        build_sweep("digits", None, (), ["optim.lr=0.1,fast"], str(tmp_path / "s"))
    with pytest.raises(UserError) as err:
        build_sweep("digits", None, (), ["optim.lrr=0.1"], str(tmp_path / "s"))
    assert "sweep point p000_lrr=0.1" in str(err.value) and "Did you mean 'optim.lr'?" in str(err.value)
    # the batch arithmetic of every point against the job's shape (2 nodes x 3 processes)
    with pytest.raises(UserError, match=r"sweep point p001_global_batch_size=32 .*: .*cannot be split evenly across 6"):
        build_sweep("digits", None, ("slurm.nodes=2", "slurm.gpus_per_node=3", "train.micro_batch_size=8"),
                   ["train.global_batch_size=48,32"], str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()  # nothing written for a refused sweep


def test_the_sweep_dir_holds_one_sweep(tmp_path):
    plan, configs = build_sweep("digits", None, ("train.max_steps=4",), ["optim.lr=0.1,0.2"], str(tmp_path / "s"))
    write_sweep(plan, configs)
    write_sweep(plan, configs)  # the same sweep again: fine (going on with it)
    assert read_plan(tmp_path / "s") == plan
    assert "lr = 0.2" in (tmp_path / "s" / "configs" / "p001_lr=0.2.toml").read_text()
    other, other_configs = build_sweep("digits", None, (), ["optim.lr=0.3"], str(tmp_path / "s"))
    with pytest.raises(UserError, match="already holds another sweep"):
        write_sweep(other, other_configs)
    toml = tmp_path / "s" / "sweep.toml"  # the same axes, its points named otherwise (another hpctrain version)
    toml.write_text(toml.read_text().replace('"p001_lr=0.2"', '"p001_0.2"'))
    with pytest.raises(UserError, match="differs: its points' names"):
        write_sweep(plan, configs)


# ---- the array -------------------------------------------------------------------------------------------------

def _array(tmp_path, *extra: str):
    plan, configs = build_sweep("digits", None, ("slurm.nodes=1", "slurm.gpus_per_node=1", "slurm.gpus=false",
                                                *extra), ["optim.lr=1e-3,3e-3", "train.micro_batch_size=25,50"],
                               "/shared/sweeps/lr")
    spec = array.array_spec(plan, configs, max_parallel=2)
    return plan, dataclasses.replace(spec, workdir="/home/user/project", python="/home/user/venv/bin/python",
                                     venv="/home/user/venv", version="0.1.0")


def test_the_array_script_matches_its_golden_file_and_is_valid_bash(tmp_path):
    _, spec = _array(tmp_path)
    text = render_script(spec)
    path = GOLDEN / "slurm_sweep_array.sh"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"render changed; if intended, UPDATE_GOLDEN=1 and review {path}"
    assert "#SBATCH --array=0-3%2" in text and "#SBATCH --output=/shared/sweeps/lr/logs/%x_%A_%a.out" in text
    assert 'RUN_DIR="$SWEEP_DIR/$POINT"' in text and 'cp "$SWEEP_DIR/configs/$POINT.toml"' in text
    assert "HPCTRAIN_CONFIG_EOF" not in text  # the points' configs are files of the sweep, not embedded
    proc = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


def test_the_array_script_runs_its_point(tmp_path):
    """The script's own lines, up to the launch, in bash with a task id: the point's run dir and config."""
    plan, spec = _array(tmp_path)
    sweep = tmp_path / "sweep"
    spec = dataclasses.replace(spec, array=dataclasses.replace(spec.array, sweep_dir=str(sweep)), workdir=str(tmp_path),
                               venv="")
    (sweep / "configs").mkdir(parents=True)
    for p in plan.points:
        (sweep / "configs" / f"{p.name}.toml").write_text(f"# {p.name}\n")
    text = render_script(spec).split("# --- launch")[0] + 'echo "RESULT $RUN_DIR $(cat "$CONFIG")"\n'
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_JOB_ID": "77", "SLURM_JOB_ID": "79",
           "SLURM_JOB_NODELIST": "node1"}
    proc = subprocess.run(["bash", "-c", text], env=env, text=True, capture_output=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"RESULT {sweep}/p002_lr=3e-3_micro_batch_size=25 # p002_lr=3e-3_micro_batch_size=25" in proc.stdout


def test_an_array_above_max_array_size_is_an_error_with_what_to_do(tmp_path):
    plan, spec = _array(tmp_path)
    cfg = build_sweep("digits", None, (), ["optim.lr=1e-3"], str(tmp_path / "x"))[1]["p000_lr=1e-3"]
    assert not [f for f in lint.lint(cfg, spec, Facts(max_array_size=4)) if f.key == "--grid"]  # indices 0..3 fit
    found = [f for f in lint.lint(cfg, spec, Facts(max_array_size=3)) if f.key == "--grid"]
    assert found and found[0].level == "error" and "MaxArraySize is 3" in found[0].message
    assert "sweeps of at most 3 points" in found[0].hint


def test_a_failed_task_s_error_line_is_the_cause_not_the_script_s_last_line(tmp_path):
    from hpctrain.sweep.grid import Point
    from hpctrain.sweep.spec import SweepSpec

    sweep = tmp_path / "s"
    (sweep / "logs").mkdir(parents=True)
    plan = SweepSpec(sweep, "digits", "", (), (Axis("optim.lr", ("0.1",)),), (Point(0, "p000_lr=0.1", ()),))
    (sweep / "logs" / "sweep-s_12_0.out").write_text(
        "hpctrain: sweep point p000_lr=0.1 (array task 0 of job 12)\nhpctrain: launching: srun ...\n"
        "12:00:01 INFO step: eager (auto: ...)\nhpctrain: worker rank 0 (local rank 0, pid 9, node1) failed first, "
        "exit code 1: RuntimeError: loss is NaN\nhpctrain: job step ended with exit code 1 at 2026-11-26T12:00:09\n")
    state, detail = status._state_from_log(plan, "12", 0)
    assert state == "failed" and "RuntimeError: loss is NaN" in detail
    (sweep / "logs" / "sweep-s_12_0.out").write_text("hpctrain: job step ended with exit code 0 at 12:00\n")
    assert status._state_from_log(plan, "12", 0) == ("done", "")


def test_slurm_s_states_map_to_a_point_s_state():
    assert status._slurm_state("PENDING", "1", "0:0", "BeginTime") == ("requeued", "requeued 1 time(s), BeginTime")
    assert status._slurm_state("RUNNING", "0", "0:0", "None") == ("running", "")
    assert status._slurm_state("TIMEOUT", "0", "0:15", "") == ("failed", "exit code 0:15")
    assert status._indices("[2-5%2]") == [2, 3, 4, 5] and status._indices("0,4-5") == [0, 4, 5]
    assert status._indices("N/A") == []


# ---- Slurm's view of a sweep's arrays (stand-in Slurm commands on PATH) ---------------------------------------

FAKE_COMMAND = """#!/bin/bash
# a stand-in Slurm command: prints ANSWERS/<command>_<job id> (the id after -j/--jobs, else the last argument)
cmd=$(basename "$0"); id="${@: -1}"; prev=""
for a in "$@"; do case "$prev" in -j|--jobs) id="$a";; esac; prev="$a"; done
[ "$cmd" = sbatch ] && id=next
if [ -f "ANSWERS/${cmd}_$id" ]; then cat "ANSWERS/${cmd}_$id"; exit 0; fi
[ "$cmd" = scontrol ] && { echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; }
exit 0
"""


class FakeSlurm:
    """sbatch, scontrol, sacct and squeue on PATH answering what a test tells them; a job it was told nothing
    about is one Slurm has forgotten (scontrol: invalid job id; sacct, squeue: nothing)."""

    def __init__(self, root: Path):
        self.answers = root / "answers"
        self.answers.mkdir(parents=True)
        self.bin = root / "bin"
        self.bin.mkdir()
        for name in ("sbatch", "scontrol", "sacct", "squeue"):
            (self.bin / name).write_text(FAKE_COMMAND.replace("ANSWERS", str(self.answers)))
            (self.bin / name).chmod(0o755)

    def answer(self, command: str, job_id: str, text: str) -> None:
        (self.answers / f"{command}_{job_id}").write_text(text)

    def forget(self, command: str, job_id: str) -> None:
        (self.answers / f"{command}_{job_id}").unlink()


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    fake = FakeSlurm(tmp_path / "slurm")
    monkeypatch.setenv("PATH", f"{fake.bin}{os.pathsep}{os.environ['PATH']}")
    return fake


def _lr_sweep(tmp_path, *settings: str, lrs: str = "0.1,0.2,0.3"):
    plan, configs = build_sweep("digits", None, ("train.max_steps=4", *settings), [f"optim.lr={lrs}"],
                               str(tmp_path / "s"))
    return plan, configs


def _submit(plan, configs, fake: FakeSlurm, job_id: str, indices: tuple[int, ...] = ()) -> None:
    """What `sweep submit` records for an array (its script, its id), through job.submit and the stand-in sbatch."""
    write_sweep(plan, configs)
    fake.answer("sbatch", "next", f"{job_id}\n")
    assert job.submit(render_script(array.array_spec(plan, configs, 0, indices)), plan.sweep_dir) == job_id


def _task_ended(plan, job_id: str, index: int, code: int, error: str = "", accuracy: float | None = None) -> None:
    """A task's log as the array script ends it, and its point's validation metric."""
    (plan.sweep_dir / "logs" / f"sweep-s_{job_id}_{index}.out").write_text(
        f"hpctrain: sweep point {plan.points[index].name}\n{error}\n"
        f"hpctrain: job step ended with exit code {code} at 2026-11-27T12:00:00\n")
    if accuracy is not None:
        run_dir = plan.run_dir(plan.points[index])
        run_dir.mkdir(exist_ok=True)
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 4, "split": "train", "loss": 0.5, "time": 1.0}) + "\n")
            f.write(json.dumps({"step": 4, "split": "val", "loss": 0.4, "accuracy": accuracy, "time": 1.0}) + "\n")


def _states(plan) -> dict[str, tuple[str, str]]:
    return {s.name.split("_", 1)[0]: (s.state, s.detail) for s in status.collect_status(plan)}


def test_a_resubmitted_sweep_keeps_what_its_earlier_array_finished(tmp_path, slurm):
    """Array 100 runs every point and p001 fails; array 200 runs p001 again. The points 100 finished stay done
    (their state from 100's logs: Slurm has forgotten 100), nothing is queued again, and the best is the best."""
    plan, configs = _lr_sweep(tmp_path)
    _submit(plan, configs, slurm, "100")
    _task_ended(plan, "100", 0, 0, accuracy=0.95)
    _task_ended(plan, "100", 1, 1, "hpctrain: error: loss is NaN")
    _task_ended(plan, "100", 2, 0, accuracy=0.93)
    assert _states(plan)["p001"] == ("failed", "hpctrain: error: loss is NaN")
    assert array.unfinished(plan) == ("1",)
    _submit(plan, configs, slurm, "200", (1,))
    assert "#SBATCH --array=1\n" in (plan.sweep_dir / "slurm" / "job_200.sh").read_text()
    slurm.answer("scontrol", "200", "JobId=200 JobName=sweep-s ArrayJobId=200 ArrayTaskId=1 JobState=COMPLETED "
                                    "Reason=None Restarts=0 ExitCode=0:0 RunTime=00:01:10\n")
    _task_ended(plan, "200", 1, 0, accuracy=0.90)
    assert _states(plan) == {"p000": ("done", ""), "p001": ("done", ""), "p002": ("done", "")}
    assert array.unfinished(plan) == ("none",)
    table = sweep_table(plan, point_results(plan, "accuracy", True, status.collect_status(plan)), "accuracy", True)
    assert "| 1 | p000_lr=0.1 | 0.1 | 0.95 **best** |" in table and "| 3 | p001_lr=0.2 | 0.2 | 0.9 |" in table


def test_a_task_cancelled_before_it_started_is_cancelled_not_started_and_runs_again(tmp_path, slurm):
    plan, configs = _lr_sweep(tmp_path)
    _submit(plan, configs, slurm, "300")
    _task_ended(plan, "300", 0, 0, accuracy=0.95)
    (plan.sweep_dir / "logs" / "sweep-s_300_1.out").write_text("hpctrain: sweep point p001_lr=0.2\n")  # it started
    slurm.answer("scontrol", "300",
                 "JobId=300 ArrayJobId=300 ArrayTaskId=0 JobState=COMPLETED Reason=None ExitCode=0:0 RunTime=00:02:00\n"
                 "JobId=301 ArrayJobId=300 ArrayTaskId=1 JobState=CANCELLED Reason=None ExitCode=0:15 RunTime=00:00:00\n"
                 "JobId=300 ArrayJobId=300 ArrayTaskId=2 JobState=CANCELLED Reason=None ExitCode=0:0 RunTime=00:00:00\n")
    want = {"p000": ("done", ""), "p001": ("cancelled", ""), "p002": ("cancelled", "not started")}
    assert _states(plan) == want
    assert array.unfinished(plan) == ("1", "2")
    # the same from accounting, once scontrol has forgotten the array (a pending range cancelled is one record)
    slurm.forget("scontrol", "300")
    slurm.answer("sacct", "300", "300_0|COMPLETED|0:0|00:02:00\n300_1|CANCELLED by 1000|0:15|00:00:00\n"
                                 "300_[2]|CANCELLED by 1000|0:0|00:00:00\n")
    assert _states(plan) == want
    slurm.forget("sacct", "300")  # forgotten by both: the task that wrote no log never started
    assert _states(plan)["p002"] == ("not started", "Slurm no longer knows task 300_2 and it wrote no log")


def test_a_used_sweep_dir_refuses_another_grid_or_setting_even_when_every_point_is_done(tmp_path, slurm):
    plan, configs = _lr_sweep(tmp_path)
    _submit(plan, configs, slurm, "100")
    for index in range(3):
        _task_ended(plan, "100", index, 0, accuracy=0.9)
    req = commands.SubmitRequest("digits", None, ("train.max_steps=4",), ("optim.lr=0.1,0.2,0.3",),
                                 str(plan.sweep_dir))
    assert commands.submit_command(req) == 0  # the same sweep, finished: nothing to submit
    for change, words in (({"grid": ("optim.lr=0.1,0.2,3e-2",)},
                           "axes --grid optim.lr=0.1,0.2,0.3, now --grid optim.lr=0.1,0.2,3e-2"),
                          ({"overrides": ("train.max_steps=8",)},
                           "shared settings train.max_steps=4, now train.max_steps=8")):
        for local in (False, True):
            with pytest.raises(UserError, match="already holds another sweep") as err:
                commands.submit_command(dataclasses.replace(req, local=local, **change))
            assert words in str(err.value) and "another --dir" in err.value.hint
    assert len(job.recorded_jobs(plan.sweep_dir)) == 1 and read_plan(plan.sweep_dir) == plan  # nothing changed


def test_a_local_sweep_is_refused_while_its_array_is_queued_or_cannot_be_checked(tmp_path, slurm, monkeypatch):
    plan, configs = _lr_sweep(tmp_path)
    _submit(plan, configs, slurm, "100")
    ran = []
    monkeypatch.setattr(commands, "run_locally", lambda plan, nproc: ran.append(plan.sweep_dir) or 0)
    req = commands.SubmitRequest("digits", None, ("train.max_steps=4",), ("optim.lr=0.1,0.2,0.3",),
                                 str(plan.sweep_dir), local=True)
    slurm.answer("squeue", "100", "100_[1-2]\n100_0\n")
    with pytest.raises(UserError, match="still has array job 100 queued or running") as err:
        commands.submit_command(req)
    assert "hpctrain slurm cancel 100" in err.value.hint and not ran
    slurm.forget("squeue", "100")  # the array has left the queue
    assert commands.submit_command(req) == 0 and ran == [plan.sweep_dir]
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # another machine: no squeue to ask
    with pytest.raises(UserError, match="array job 100, and 'squeue' was not found") as err:
        commands.submit_command(req)
    assert "--force" in err.value.hint and len(ran) == 1
    assert commands.submit_command(dataclasses.replace(req, force=True)) == 0 and len(ran) == 2


# ---- the report --------------------------------------------------------------------------------------------------

def test_the_report_ranks_points_by_the_main_metric_marks_the_best_and_lists_failures():
    from hpctrain.sweep.spec import SweepSpec

    plan = SweepSpec(Path("/s/lr"), "digits", "", (), (Axis("optim.lr", ("1e-3", "3e-3", "1e-2")),), ())
    results = [
        PointResult("p000_lr=1e-3", (("optim.lr", "1e-3"),), "done", 40, 0.91, 0.92, 30),
        PointResult("p001_lr=3e-3", (("optim.lr", "3e-3"),), "done", 40, 0.95, 0.95, 40),
        PointResult("p002_lr=1e-2", (("optim.lr", "1e-2"),), "failed", 12, None, None, None,
                    "hpctrain: error: loss is NaN"),
    ]
    want = """# Sweep report: lr

Sweep dir: `/s/lr`; experiment digits; 3 point(s); ranked by the final validation accuracy (higher is better).

| rank | point | optim.lr | final accuracy | best accuracy (step) | steps | state |
|---:|---|---|---:|---:|---:|---|
| 1 | p001_lr=3e-3 | 3e-3 | 0.95 **best** | 0.95 (40) | 40 | done |
| 2 | p000_lr=1e-3 | 1e-3 | 0.91 | 0.92 (30) | 40 | done |
| - | p002_lr=1e-2 | 1e-2 | - | - | 12 | failed |

## Failed points

- p002_lr=1e-2: hpctrain: error: loss is NaN
"""
    assert sweep_table(plan, results, "accuracy", higher=True) == want
    running = results + [PointResult("p003_lr=3e-2", (("optim.lr", "3e-2"),), "running", 20, 0.97, 0.97, 20)]
    text = sweep_table(plan, running, "accuracy", higher=True)
    assert "| 1 | p001_lr=3e-3 | 3e-3 | 0.95 **best** |" in text and "| 3 | p003_lr=3e-2 | 3e-2 | 0.97 |" in text
    lower = sweep_table(plan, results, "accuracy", higher=False)
    assert lower.index("p000_lr=1e-3 | 1e-3 | 0.91 **best**") < lower.index("p001_lr=3e-3")


# ---- --local, end to end -------------------------------------------------------------------------------------

def test_a_local_sweep_runs_every_point_reports_them_and_equals_runs_made_alone(tmp_path):
    sweep = tmp_path / "sweep"
    common = ["train.max_steps=6", "eval.every_steps=3"]
    grid = ["--grid", "optim.lr=0.02", "--grid", "model.samples=512,16"]
    res = run_hpctrain(["sweep", "submit", TOY, *common, *grid, "--dir", str(sweep), "--local"], timeout=300)
    assert res.returncode == 1, res.output  # a point failed: the sweep says so
    assert "sweep done: 1 point(s) finished, 1 failed" in res.stderr
    shown = run_hpctrain(["sweep", "status", str(sweep)])
    assert shown.returncode == 0, shown.output
    lines = {line.split("|")[1].strip(): line for line in shown.stdout.splitlines() if line.startswith("| p0")}
    assert "| done | 6 | loss " in lines["p000_lr=0.02_samples=512"]
    assert "| failed |" in lines["p001_lr=0.02_samples=16"] and "fewer than one global batch" in shown.stdout
    report = run_hpctrain(["report", str(sweep)])
    assert report.returncode == 0, report.output
    assert {p.name for p in (sweep / "report").iterdir()} == {"summary.md", "index.html", "curves.png",
                                                              "curves_by_lr.png"}
    assert "## Failed points" in report.stdout and "p001_lr=0.02_samples=16: hpctrain: error:" in report.stdout
    # a finished point is exactly what `hpctrain train` gives for its settings
    alone = tmp_path / "alone"
    res = run_hpctrain(["train", TOY, *common, "optim.lr=0.02", "model.samples=512", f"run.dir={alone}"])
    assert res.returncode == 0, res.output
    val = lambda d: [{k: v for k, v in r.items() if k != "time"} for r in read_jsonl(d / "metrics.jsonl")  # noqa: E731
                     if r["split"] == "val"]
    assert val(sweep / "p000_lr=0.02_samples=512") == val(alone) and len(val(alone)) == 2
    assert f"| 1 | p000_lr=0.02_samples=512 | 0.02 | 512 | {val(alone)[-1]['loss']:.4g} **best** |" in report.stdout
    # the same command again goes on with the same sweep (finished points have nothing to do)
    again = run_hpctrain(["sweep", "submit", TOY, *common, *grid, "--dir", str(sweep), "--local"], timeout=300)
    assert "already complete" in again.stderr and json.loads(
        (sweep / "status" / "p000_lr=0.02_samples=512.json").read_text())["state"] == "done"


def test_a_point_s_shutdown_output_after_ctrl_c_does_not_block_the_sweep(tmp_path):
    """Ctrl-C reaches the sweep and its point; the point writes 230 KiB (more than a pipe holds) while it stops.
    The sweep reads it all, and returns the point's exit as an interrupt with its last error line."""
    point = tmp_path / "point.py"
    point.write_text(textwrap.dedent("""
        import signal, sys, time

        def stop(*_):
            sys.stderr.write(("shutting down " + "x" * 100 + "\\n") * 2000)
            sys.stderr.write("RuntimeError: the last error line\\n")
            sys.exit(0)

        signal.signal(signal.SIGINT, stop)
        print("ready", flush=True)
        time.sleep(60)
    """))
    sweep = ("import sys; from hpctrain.sweep.local import _run_point; "
             "print('RESULT', _run_point([sys.executable, sys.argv[1]]), flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", sweep, str(point)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    watchdog = threading.Timer(60, kill_tree, [proc.pid])  # never hang the suite, even before "ready"
    watchdog.start()
    try:
        assert proc.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"the sweep hung on its point's shutdown output (hard timeout)\n{out}\n{err[-2000:]}")
    finally:
        watchdog.cancel()
    assert "RESULT (130, 'RuntimeError: the last error line')" in out, err[-2000:]
    assert err.count("shutting down") == 2000


def test_a_dry_run_prints_the_points_and_the_script_and_writes_nothing(tmp_path):
    sweep = tmp_path / "sweep"
    res = run_hpctrain(["sweep", "submit", "digits", "--grid", "optim.lr=1e-3,3e-3", "--max-parallel", "1",
                        "slurm.gpus=false", "--dir", str(sweep), "--dry-run"])
    assert res.returncode == 0, res.output
    assert "| p001 | 3e-3 |" in res.stderr and "#SBATCH --array=0-1%1" in res.stdout
    assert not sweep.exists()


def test_a_requeue_names_the_array_task_never_the_array():
    from hpctrain.dist.env import requeue_id

    task = {"SLURM_JOB_ID": "812", "SLURM_ARRAY_JOB_ID": "812", "SLURM_ARRAY_TASK_ID": "3"}  # the last task started
    assert requeue_id(task) == "812_3" and requeue_id({"SLURM_JOB_ID": "77"}) == "77" and requeue_id({}) == ""
