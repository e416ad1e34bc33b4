"""The command line of a script job (--script PATH, --module MODULE, the script's arguments after --): bad input is a
message with what to do (exit 2, no traceback, nothing written), the settings the user gave, the run dir, a
script run dir where only reports apply, and a script's sweep (its arguments per point, its metric)."""

from __future__ import annotations

import os
import re
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import pytest

from hpctrain.cli import main
from hpctrain.config.load import load_config
from hpctrain.config.schema import NoModelOptions
from hpctrain.slurm import job
from hpctrain.sweep.grid import script_args_of
from hpctrain.sweep.metric import MetricSource, curve_from_log, curve_from_records


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A folder holding a script, made the working directory."""
    (tmp_path / "train.py").write_text("print('a torchrun script')\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv, words", [
    (["train", "--script", "nope.py"], ["script", "nope.py does not exist", "--script"]),
    (["train", "nope.py"], ["there is no script 'nope.py'", "an EXPERIMENT that ends in .py names a script"]),
    (["train", "./runner"], ["unknown experiment './runner'", "no such file", "--script PATH"]),
    (["train", "--script", "train.py", "digits"], ["'digits' names an experiment as well", "give one of them"]),
    (["slurm", "render", "digits", "--module", "pkg.train"], ["--module runs your own script"]),
    (["train", "digits", "--", "--lr", "3"], ["arguments after -- go to a script", "--script PATH"]),
    (["train"], ["no experiment and no script given", "--script PATH"]),
    (["train", "--script", "train.py", "--resume", "never"], ["a script resumes from its own"]),
    (["slurm", "render", "--module", "not a module"], ["'not a module' is not a Python module name"]),
    (["slurm", "render", "--script", "train.py", "slurm.launcher=srun"], ["slurm.launcher=srun does not run a script"]),
    (["slurm", "render", "--script", "train.py", "fault.requeue_exit_codes=[300]"], ["fault.requeue_exit_codes"]),
    (["sweep", "submit", "digits", "--grid", "lr=1e-3,2e-3"], ["--grid lr: not a config key", "--script PATH"]),
    (["sweep", "submit", "digits", "--grid", "optim.lr=1e-3", "--metric", "acc"], ["are for a script's sweep"]),
    (["sweep", "submit", "--script", "train.py", "--grid", "lr=1,2", "--metric-line", "loss=[0-9"],
     ["is no regular expression"]),
    (["sweep", "submit", "--script", "train.py", "--grid", "lr=1,2", "--metric-line", "loss=[0-9.]+"],
     ["has no group"]),
])
def test_bad_script_command_lines_are_a_message_not_a_traceback(folder, capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpctrain: error: ") and "Traceback" not in err and "HINT:" in err
    for w in words:
        assert w in err, err
    assert not (folder / "runs").exists() and not (folder / "sweeps").exists()  # nothing written


def test_script_and_module_together_are_refused_by_the_parser(folder, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["slurm", "render", "--script", "train.py", "--module", "pkg.train"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_arguments_after_the_double_dash_are_the_scripts_never_read(folder, capsys):
    """A positional train.py that exists means --script; key=value before -- is hpctrain's, after it the script's
    (even when it looks like hpctrain's own)."""
    assert main(["slurm", "render", "train.py", "--nproc-per-node", "2", "slurm.nodes=2",
                 "--", "--lr", "3e-4", "slurm.nodes=9", "--script", "x", "--"]) == 0
    text = capsys.readouterr().out
    launch = next(line for line in text.splitlines() if line.startswith("LAUNCH=("))
    assert launch.endswith(" --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=\"$MASTER_ADDR:$MASTER_PORT\" "
                           "--rdzv-id=\"$SLURM_JOB_ID\" --max-restarts=0 train.py --lr 3e-4 slurm.nodes=9 --script x --)")
    assert "#SBATCH --nodes=2\n" in text and "#SBATCH --gres=gpu:2\n" in text  # --nproc-per-node: GPUs per node
    assert f"RUN_DIR={folder}/runs/train\n" in text


def settings_in(script: str) -> str:
    return re.search(r"<<'HPCTRAIN_SETTINGS_EOF'\n(.*?)\nHPCTRAIN_SETTINGS_EOF", script, re.S).group(1)


def test_the_settings_hold_only_what_was_given_and_the_run_dir(folder, capsys):
    (folder / "job.toml").write_text('[slurm]\nnodes = 2\npartition = "gpu"\n\n[fault]\nrequeue_exit_codes = [76]\n')
    assert main(["slurm", "render", "--module", "pkg.train", "--config", "job.toml", "run.seed=3",
                 "slurm.gpus_per_node=4", "--nproc-per-node", "4"]) == 0
    settings = settings_in(capsys.readouterr().out)
    assert settings == ('experiment = "script:-m pkg.train"\n\n[slurm]\nnodes = 2\npartition = "gpu"\n'
                        'gpus_per_node = 4\n\n[fault]\nrequeue_exit_codes = [\n    76,\n]\n\n[run]\nseed = 3\n'
                        f'dir = "{folder}/runs/train"')


def test_nproc_per_node_against_the_gpus_given_is_the_lints_error(folder, capsys):
    assert main(["slurm", "check", "--script", "train.py", "slurm.gpus_per_node=4", "--nproc-per-node", "2"]) == 1
    assert "ERROR   --nproc-per-node: torchrun would start 2 processes per node, but the job asks for --gres=gpu:4" \
        in capsys.readouterr().err


def test_the_default_run_dir_and_job_name_are_the_scripts_stem():
    for experiment in ("script:tools/train.py", "script:-m pkg.train"):
        cfg = load_config(experiment, NoModelOptions)
        assert cfg.run_dir == "runs/train" and cfg.run_name == "train" and job.job_spec(cfg).job_name == "train"


def test_submit_writes_the_config_and_the_settings_before_sbatch(folder, monkeypatch, capsys):
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho '4242;cluster'\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run = folder / "shared" / "run"
    assert main(["slurm", "submit", "--script", "train.py", f"run.dir={run}", "slurm.time=60", "--", "--lr", "1"]) == 0
    assert capsys.readouterr().out.strip() == "4242"
    assert tomllib.loads((run / "settings.toml").read_text()) == \
        {"experiment": "script:train.py", "run": {"dir": str(run)}, "slurm": {"time": "60"}}
    assert 'experiment = "script:train.py"' in (run / "config.toml").read_text()
    assert job.recorded_jobs(run) == ["4242"] and "train.py --lr 1)" in (run / "slurm" / "job_4242.sh").read_text()


def test_a_script_run_dir_is_reported_but_not_evaluated_exported_or_sampled(folder, capsys):
    run = folder / "runs" / "train"
    run.mkdir(parents=True)
    (run / "config.toml").write_text('experiment = "script:train.py"\n')
    from PIL import Image

    Image.new("RGB", (4, 4)).save(folder / "face.jpg")  # predict reads its images first
    for argv in (["export", str(run), "--out", str(folder / "w.safetensors")], ["sample", str(run)],
                 ["predict", str(run), "face.jpg"], ["eval", "script:train.py", f"run.dir={run}"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "is a script run by torchrun (train.py), not an hpctrain experiment" in err, err
        assert "hpctrain report RUN_DIR" in err
    (run / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 0.5}\n')
    assert main(["report", str(run)]) == 0


def test_a_points_script_arguments():
    base = ("--out", "/s/p000/own", "--lr={lr}")
    assert script_args_of(base, (("lr", "1e-4"), ("optim.lr", "5"), ("epochs", "3"), ("-b", "8"))) == \
        ("--out", "/s/p000/own", "--lr=1e-4", "--epochs", "3", "-b", "8")


def test_a_script_sweeps_points_keep_their_arguments_and_settings(folder, capsys):
    assert main(["sweep", "submit", "--script", "train.py", "--grid", "lr=0.1,0.2", "--grid", "run.seed=1,2",
                 "--dir", "s", "--dry-run", "slurm.gpus=false", "--", "--out", "{run_dir}/own"]) == 0
    text = capsys.readouterr().out
    sweep = folder / "s"
    assert f"  0) SCRIPT_ARGS=(--out {sweep}/p000_lr=0.1_seed=1/own --lr 0.1) ;;" in text
    assert f"  3) SCRIPT_ARGS=(--out {sweep}/p003_lr=0.2_seed=2/own --lr 0.2) ;;" in text


def test_a_script_sweeps_point_run_here_is_hpctrain_train_with_its_settings(folder):
    from hpctrain.sweep.local import point_command
    from hpctrain.sweep.spec import build_sweep, write_sweep

    plan, configs = build_sweep("script:-m pkg.train", None, ("slurm.nodes=2",), ["lr=0.1,0.2", "run.seed=5"],
                                str(folder / "s"), script_args=("--epochs", "2"))
    write_sweep(plan, configs)
    point = plan.points[1]
    assert tomllib.loads(plan.settings_path(point).read_text()) == {  # what was given, the point's own run dir
        "experiment": "script:-m pkg.train", "slurm": {"nodes": 2}, "run": {"seed": 5, "dir": str(plan.run_dir(point))}}
    command = point_command(plan, point, 2)
    assert command[command.index("train"):] == [
        "train", "--module", "pkg.train", "--config", str(folder / "s" / "settings" / "p001_lr=0.2_seed=5.toml"),
        "--nproc-per-node", "2", "--", "--epochs", "2", "--lr", "0.2"]


def test_a_points_metric_from_its_records_or_its_log():
    records = [{"step": 5, "split": "train", "loss": 2.0}, {"step": 9, "split": "stop"},
               {"step": 10, "split": "train", "loss": 1.0}]
    script = MetricSource(name="loss", higher_is_better=False, validation_only=False)
    assert curve_from_records(records, script) == [(5, 2.0), (10, 1.0)]
    assert curve_from_records(records + [{"step": 10, "split": "val", "loss": 1.5}], script) == [(10, 1.5)]
    assert curve_from_records(records, MetricSource(name="loss", higher_is_better=False)) == []  # validation only
    log = "epoch 1 loss=3.5\nnoise loss=x\nepoch 2 loss=0.25\n"
    assert curve_from_log(log, r"loss=([0-9.]+)") == [(1, 3.5), (2, 0.25)]
    assert curve_from_log(log, r"epoch (?P<step>\d+) loss=(?P<value>[0-9.]+)") == [(1, 3.5), (2, 0.25)]
