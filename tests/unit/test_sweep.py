"""Sweeps (hpctrain.sweep): the grid, every point checked before anything is written, the array script (golden),
the lint against MaxArraySize, Slurm's view of an array parsed, the report's table (golden), and a --local sweep of
the toy experiment end to end: a failed point listed with its error, a finished one equal to the same config run
alone with `hpctrain train`. The array on a real two-node Slurm cluster: the last test of
tests/slurm/test_cluster.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from hpctrain.errors import UserError
from hpctrain.slurm import lint
from hpctrain.slurm.facts import Facts
from hpctrain.slurm.render import render_script
from hpctrain.sweep import commands
from hpctrain.sweep.grid import Axis, MAX_POINTS, grid_points, parse_axis
from hpctrain.sweep.plan import build_plan, read_plan, write_plan
from hpctrain.sweep.report import PointResult, sweep_table
from tests.conftest import read_jsonl, run_hpctrain

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
        build_plan("digits", None, (), ["optim.lr=0.1,fast"], str(tmp_path / "s"))
    with pytest.raises(UserError) as err:
        build_plan("digits", None, (), ["optim.lrr=0.1"], str(tmp_path / "s"))
    assert "sweep point p000_lrr=0.1" in str(err.value) and "Did you mean 'optim.lr'?" in str(err.value)
    # the batch arithmetic of every point against the job's shape (2 nodes x 3 processes)
    with pytest.raises(UserError, match=r"sweep point p001_global_batch_size=32 .*: .*cannot be split evenly across 6"):
        build_plan("digits", None, ("slurm.nodes=2", "slurm.gpus_per_node=3", "train.micro_batch_size=8"),
                   ["train.global_batch_size=48,32"], str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()  # nothing written for a refused sweep


def test_the_sweep_dir_holds_one_sweep(tmp_path):
    plan, configs = build_plan("digits", None, ("train.max_steps=4",), ["optim.lr=0.1,0.2"], str(tmp_path / "s"))
    write_plan(plan, configs)
    write_plan(plan, configs)  # the same sweep again: fine (going on with it)
    assert read_plan(tmp_path / "s") == plan
    assert "lr = 0.2" in (tmp_path / "s" / "configs" / "p001_lr=0.2.toml").read_text()
    other, other_configs = build_plan("digits", None, (), ["optim.lr=0.3"], str(tmp_path / "s"))
    with pytest.raises(UserError, match="already holds another sweep"):
        write_plan(other, other_configs)


# ---- the array -------------------------------------------------------------------------------------------------

def _array(tmp_path, *extra: str):
    plan, configs = build_plan("digits", None, ("slurm.nodes=1", "slurm.gpus_per_node=1", "slurm.gpus=false",
                                                *extra), ["optim.lr=1e-3,3e-3", "train.micro_batch_size=25,50"],
                               "/shared/sweeps/lr")
    spec = commands.array_spec(plan, configs, max_parallel=2)
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
    cfg = build_plan("digits", None, (), ["optim.lr=1e-3"], str(tmp_path / "x"))[1]["p000_lr=1e-3"]
    assert not [f for f in lint.lint(cfg, spec, Facts(max_array_size=4)) if f.key == "--grid"]  # indices 0..3 fit
    found = [f for f in lint.lint(cfg, spec, Facts(max_array_size=3)) if f.key == "--grid"]
    assert found and found[0].level == "error" and "MaxArraySize is 3" in found[0].message
    assert "sweeps of at most 3 points" in found[0].hint


def test_a_failed_task_s_error_line_is_the_cause_not_the_script_s_last_line(tmp_path):
    from hpctrain.sweep.grid import Point
    from hpctrain.sweep.plan import SweepPlan

    sweep = tmp_path / "s"
    (sweep / "logs").mkdir(parents=True)
    plan = SweepPlan(sweep, "digits", "", (), (Axis("optim.lr", ("0.1",)),), (Point(0, "p000_lr=0.1", ()),))
    (sweep / "logs" / "sweep-s_12_0.out").write_text(
        "hpctrain: sweep point p000_lr=0.1 (array task 0 of job 12)\nhpctrain: launching: srun ...\n"
        "12:00:01 INFO step: eager (auto: ...)\nhpctrain: worker rank 0 (local rank 0, pid 9, node1) failed first, "
        "exit code 1: RuntimeError: loss is NaN\nhpctrain: job step ended with exit code 1 at 2026-11-26T12:00:09\n")
    state, detail = commands._state_from_log(plan, "12", 0)
    assert state == "failed" and "RuntimeError: loss is NaN" in detail
    (sweep / "logs" / "sweep-s_12_0.out").write_text("hpctrain: job step ended with exit code 0 at 12:00\n")
    assert commands._state_from_log(plan, "12", 0) == ("done", "")


def test_slurm_s_states_map_to_a_point_s_state():
    assert commands._slurm_state("PENDING", "1", "0:0", "BeginTime") == ("requeued", "requeued 1 time(s), BeginTime")
    assert commands._slurm_state("RUNNING", "0", "0:0", "None") == ("running", "")
    assert commands._slurm_state("TIMEOUT", "0", "0:15", "") == ("failed", "exit code 0:15")
    assert commands._indices("[2-5%2]") == [2, 3, 4, 5] and commands._indices("0,4-5") == [0, 4, 5]
    assert commands._indices("N/A") == []


# ---- the report --------------------------------------------------------------------------------------------------

def test_the_report_ranks_points_by_the_main_metric_marks_the_best_and_lists_failures():
    from hpctrain.sweep.plan import SweepPlan

    plan = SweepPlan(Path("/s/lr"), "digits", "", (), (Axis("optim.lr", ("1e-3", "3e-3", "1e-2")),), ())
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
    status = run_hpctrain(["sweep", "status", str(sweep)])
    assert status.returncode == 0, status.output
    lines = {line.split("|")[1].strip(): line for line in status.stdout.splitlines() if line.startswith("| p0")}
    assert "| done | 6 | loss " in lines["p000_lr=0.02_samples=512"]
    assert "| failed |" in lines["p001_lr=0.02_samples=16"] and "fewer than one global batch" in status.stdout
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
