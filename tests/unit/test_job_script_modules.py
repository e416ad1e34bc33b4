"""The module paths that job scripts call still run: a requeued job re-runs the script rendered into its run dir,
whatever version of hpctrain rendered it, so each path stays after its code moves (issue 39 moved all three)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# torchrun's and srun's variables from the environment pytest runs in would make each program a rank of another launch
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RUN_ID", "HPCTRAIN_MONITOR_DIR")


def _run(module: str, args: list[str], env: dict[str, str] | None = None, timeout: float = 180):
    """``python -m MODULE ARGS``: (exit code, stdout, stderr). On a hang it is killed, and its workers and monitors
    with it (they die with their parent: dist/parent_death)."""
    full_env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("SLURM_")}
    full_env.update({"PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        done = subprocess.run([sys.executable, "-m", module, *args], env=full_env, capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"python -m {module} {' '.join(args)} hung for {timeout} s\n{hung.stdout}\n{hung.stderr}")
    return done.returncode, done.stdout, done.stderr


def test_python_m_hpctrain_launch_runs_hpctrain_on_its_workers():
    """Every rendered torchrun job script: ``python -u -m hpctrain.launch [torchrun's arguments] -m hpctrain ...``."""
    code, out, err = _run("hpctrain.launch", ["--standalone", "--nproc-per-node=1", "-m", "hpctrain", "experiments"])
    assert code == 0 and "digits" in out, err


def test_the_launch_program_reads_the_run_config_for_its_stop_line(tmp_path: Path):
    """A rendered script's launch of a training that is preempted: the program reads the run's config from its
    workers' command line (commands.train.config_from_argv), so it says the exit means "resume me" (and would send
    the run's alerts); without the config it would pass the 75 on without a word."""
    code, _, err = _run("hpctrain.launch", ["--standalone", "--nproc-per-node=1", "-m", "hpctrain", "train", "digits",
                                            f"run.dir={tmp_path / 'run'}", "train.max_steps=20", "model.width=8",
                                            "log.plots=false", "log.tensorboard=false"],
                        env={"HPCTRAIN_FAULT": "signal:rank=0:step=2"})
    assert code == 75 and "means: resume me" in err, err


def test_python_m_hpctrain_dist_torchrun_main_is_still_the_launcher():
    """Scripts rendered before the launcher moved to hpctrain.launch call this path: it runs the same program."""
    code, out, err = _run("hpctrain.dist.torchrun_main",
                          ["--standalone", "--nproc-per-node=1", "-m", "hpctrain", "experiments"])
    assert code == 0 and "digits" in out, err


def test_module_paths_of_earlier_versions_still_import():
    """Model cards exported before the reshaping load through hpctrain.train.entry; experiments copied from the
    built-in ones import the outputs hook's type from hpctrain.train.outputs."""
    from hpctrain import Outputs, resolve_config
    from hpctrain.train.entry import resolve
    from hpctrain.train.outputs import Outputs as OldOutputs

    assert OldOutputs is Outputs
    assert resolve("digits", None, ["train.max_steps=3"])[1] == resolve_config("digits", None, ("train.max_steps=3",))[1]


def test_python_m_hpctrain_slurm_task_runs_hpctrain_with_the_node_monitors(tmp_path: Path):
    """``slurm.launcher=srun`` scripts: each task runs ``python -u -m hpctrain.slurm.task ARGS``; here the one task
    of a one-task step, which is its node's first and so runs the node monitors around the command."""
    srun = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "1",
            "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "1",
            "HPCTRAIN_MONITOR_DIR": str(tmp_path), "HPCTRAIN_MONITOR_EVERY": "1"}
    code, out, err = _run("hpctrain.slurm.task", ["experiments"], env=srun)
    assert code == 0 and "digits" in out, err
    if shutil.which("top") is not None:
        assert list(tmp_path.glob("top_*.log")), "the node's first task started no monitor"
