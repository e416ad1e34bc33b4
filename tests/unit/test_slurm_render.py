"""The rendered sbatch script: golden files per shape, quoting against injection, and a dry run in bash.

Regenerate the golden files after an intended change with UPDATE_GOLDEN=1 and review the diff."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from hpctrain.config.schema import SlurmSection
from hpctrain.slurm.render import JobSpec, render_script, sbatch_quote

GOLDEN = Path(__file__).parent / "golden"
CONFIG = 'experiment = "digits"\n\n[run]\ndir = "/shared/runs/digits"\n'


def spec(**slurm) -> JobSpec:
    return JobSpec(
        slurm=SlurmSection(**slurm), job_name="digits", experiment="digits", config_toml=CONFIG,
        run_dir="/shared/runs/digits", workdir="/home/user/project", python="/home/user/venv/bin/python",
        venv="/home/user/venv", warning_signal="SIGUSR2", version="0.1.0",
    )


SHAPES = {
    "single_node": dict(nodes=1, gpus_per_node=4, partition="gpu", time="1-00:00:00"),
    "multi_node": dict(nodes=3, gpus_per_node=2, account="proj42", qos="normal", mem="200G", constraint="v100",
                       exclusive=True, modules=("CUDA/12.4", "NCCL"), extra_sbatch=("--mail-type=END",),
                       env=("WANDB_MODE=offline",), nccl_socket_ifname="ib0"),
    "container": dict(nodes=2, gpus_per_node=4, container="/images/pytorch.sif",
                      container_binds=("/data/celeba:/data",)),
    "nccl_infiniband": dict(nodes=2, nccl="infiniband", nccl_debug="INFO"),
    "nccl_ethernet": dict(nodes=2, nccl="ethernet", nccl_socket_ifname="eth0"),
    "nccl_none": dict(nodes=2, nccl="none", nccl_debug=""),
    "cpu_only": dict(nodes=2, gpus_per_node=2, gpus=False, cpus_per_task=2, monitor_every_s=0),
    "preflight": dict(nodes=2, gpus_per_node=4, preflight=True, preflight_args=("--min-busbw", "20")),
    # slurm.launcher=srun: one task per GPU, bound per task; a typed gres, the pre-flight the same way
    "srun_gpus": dict(nodes=2, gpus_per_node=4, launcher="srun", gpu_type="a100", cpus_per_task=32, preflight=True,
                      preflight_args=("--min-busbw", "20")),
    "srun_cpu_only": dict(nodes=2, gpus_per_node=2, gpus=False, cpus_per_task=2, launcher="srun"),
    "srun_one_node_unbound": dict(nodes=1, gpus_per_node=2, launcher="srun", gpu_bind="none", port=23456),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_rendered_script_matches_golden_file(shape):
    text = render_script(spec(**SHAPES[shape]))
    path = GOLDEN / f"slurm_{shape}.sh"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"render changed; if intended, UPDATE_GOLDEN=1 and review {path}"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_rendered_script_is_valid_bash(shape):
    proc = subprocess.run(["bash", "-n"], input=render_script(spec(**SHAPES[shape])), text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


def test_multi_node_script_has_the_pieces_the_guides_leave_out():
    text = render_script(spec(**SHAPES["multi_node"]))
    assert "set -euo pipefail" in text
    assert "srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task=16" in text
    assert "SLURM_NODEID" not in text  # expanded in the batch shell it would be 0 on every node
    assert "MASTER_PORT=$(( 15000 + SLURM_JOB_ID % 15000 ))" in text
    assert "#SBATCH --open-mode=append" in text and "#SBATCH --requeue" in text
    assert "#SBATCH --signal=B:USR2@120" in text and "kill -USR2" in text
    assert "--rdzv-backend=c10d" in text and "--standalone" not in text


def _line(text: str, prefix: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(prefix))


def test_srun_launcher_runs_one_task_per_gpu_each_bound_to_one():
    text = render_script(spec(**SHAPES["srun_gpus"]))
    # the allocation: one task per GPU, a quarter of the node's 32 CPUs each, GPUs as in torchrun mode
    assert "#SBATCH --ntasks-per-node=4\n#SBATCH --cpus-per-task=8\n#SBATCH --gres=gpu:a100:4\n" in text
    assert "export SRUN_CPUS_PER_TASK=8" in text and "export OMP_NUM_THREADS=4" in text
    step = "srun --kill-on-bad-exit=1 --ntasks-per-node=4 --cpus-per-task=8 --gpu-bind=per_task:1 /home/user/venv/bin/python"
    assert _line(text, "LAUNCH=(").startswith(f"LAUNCH=({step} -u -m hpctrain.slurm.task train digits --config")
    assert _line(text, "PREFLIGHT=(").startswith(f"PREFLIGHT=({step} -u -m hpctrain.slurm.task doctor --perf")
    # no torchrun, and no second GPU request beside the job's --gres (see render.gpu_binding)
    assert "torchrun" not in text.replace("no torchrun", "") and "rdzv" not in text
    assert "--gpus-per-task" not in text and "--gpus-per-node" not in text and "single:" not in text
    assert 'export MASTER_ADDR="${NODES[0]}"' in text and "MASTER_PORT=$(( 15000 + SLURM_JOB_ID % 15000 ))" in text
    assert "kill -USR2 \"${SRUN_PID:-}\"" in text  # the warning signal still goes to srun, which signals every task
    assert "HPCTRAIN_MONITOR_DIR" in text  # started by each node's first task (hpctrain.slurm.task)


def test_srun_launcher_on_cpu_nodes_binds_no_gpus():
    text = render_script(spec(**SHAPES["srun_cpu_only"]))
    assert "--gres" not in text and "--gpu-bind" not in text
    assert "#SBATCH --ntasks-per-node=2\n#SBATCH --cpus-per-task=1\n" in text
    assert "LAUNCH=(srun --kill-on-bad-exit=1 --ntasks-per-node=2 --cpus-per-task=1 /home/user/venv/bin/python -u " \
           "-m hpctrain.slurm.task train" in text


def test_srun_launcher_unbound_and_on_one_node():
    text = render_script(spec(**SHAPES["srun_one_node_unbound"]))
    assert "--gres=gpu:2" in text and "--gpu-bind" not in text  # every task sees both GPUs, takes cuda:LOCAL_RANK
    assert "--standalone" not in text  # srun tasks meet at the first node, on slurm.port when given
    assert 'export MASTER_ADDR="${NODES[0]}"' in text and "export MASTER_PORT=23456" in text


def test_srun_task_entry_runs_the_node_monitors_in_the_first_task_only(monkeypatch):
    from contextlib import contextmanager

    from hpctrain import srun_task as task

    calls = []

    @contextmanager
    def monitors():
        calls.append("monitors")
        yield []

    monkeypatch.setattr(task, "node_monitors", monitors)
    monkeypatch.setattr(task, "hpctrain_main", lambda argv: calls.append(list(argv)) or 7)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    slurm = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n[1-2]",
             "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    for local_id, expected in (("0", ["monitors", ["train", "digits"]]), ("1", [["train", "digits"]])):
        calls.clear()
        for k, v in {**slurm, "SLURM_LOCALID": local_id}.items():
            monkeypatch.setenv(k, v)
        assert task.main(["train", "digits"]) == 7  # the hpctrain command's exit code, unchanged
        assert calls == expected


def test_single_node_uses_standalone_rendezvous():
    text = render_script(spec(nodes=1))
    assert "--standalone" in text and "MASTER_ADDR" not in text and "rdzv-endpoint" not in text


def test_no_warning_signal_means_no_trap():
    text = render_script(dataclasses.replace(spec(), warning_signal="none"))
    assert "--signal" not in text and "trap '" not in text


@pytest.mark.parametrize("value,expected", [
    ("plain-name_1", "plain-name_1"),
    ("my job", '"my job"'),
    ('say "hi"', '"say \\"hi\\""'),
    ("back\\slash", '"back\\\\slash"'),
    ("$(id)", '"$(id)"'),
])
def test_sbatch_quote(value, expected):
    assert sbatch_quote(value) == expected


HOSTILE = "a b'c\"d $(touch {marker}) `touch {marker}` ;touch {marker}"

STUB = """#!/bin/bash
# records its arguments, one per line, for the test
for a in "$@"; do printf '%s\\n' "$a"; done > "{out}/$(basename "$0").args"
env > "{out}/$(basename "$0").env"
"""


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_hostile_values_cannot_inject_commands_and_reach_the_job_literally(tmp_path, launcher):
    """Run the script for real in bash, with srun/scontrol/sstat/sacct replaced by recording stubs."""
    marker = tmp_path / "INJECTED"
    hostile = HOSTILE.format(marker=marker)
    # The run dir's own name is hostile too; its marker is relative, so an injection would create it in the job's
    # working directory (tmp_path). A short name: a long temporary path three times over exceeds NAME_MAX.
    run_dir = tmp_path / f"run dir {HOSTILE.format(marker='INJECTED_BY_RUN_DIR')}"
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    for name in ("srun", "scontrol", "sstat", "sacct"):
        # scontrol show hostnames: the one node (srun mode exports MASTER_ADDR even on one node)
        (bin_dir / name).write_text(STUB.format(out=out) + ("echo node1\n" if name == "scontrol" else ""))
        (bin_dir / name).chmod(0o755)
    s = dataclasses.replace(
        spec(nodes=1, env=(f"USER_NOTE={hostile}",), setup=(), launcher=launcher),
        job_name=hostile, run_dir=str(run_dir), workdir=str(tmp_path), python=hostile, venv="",
        experiment=hostile,
    )
    script = tmp_path / "job.sh"
    script.write_text(render_script(s))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1",
           "SLURM_JOB_NUM_NODES": "1", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not marker.exists(), "a config value ran as a command"
    assert not (tmp_path / "INJECTED_BY_RUN_DIR").exists(), "the run dir's name ran as a command"
    args = (out / "srun.args").read_text().splitlines()
    assert hostile in args  # the python path and the experiment arrive as single, unchanged words
    assert args.count(hostile) == 2
    assert f"USER_NOTE={hostile}" in (out / "srun.env").read_text().splitlines()
    assert (run_dir / "slurm" / "config_42.toml").read_text() == CONFIG
    assert (run_dir / "slurm" / "launch_42.sh").exists()
    if launcher == "srun":
        assert "MASTER_ADDR=node1" in (out / "srun.env").read_text().splitlines()
