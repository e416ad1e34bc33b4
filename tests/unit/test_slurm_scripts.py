"""A script job's sbatch script (--script: the user's own torchrun script), its lint and its node records.

Golden files per shape (regenerate with UPDATE_GOLDEN=1 and review the diff), and the script run for real in bash
with stub srun/scontrol: hostile script paths and arguments stay data, and the batch shell requeues exactly when
every node recorded a requeue code (the records written by the launcher's own writer, slurm/exits.write_record)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from hpctrain.config.load import load_config
from hpctrain.config.schema import NoModelOptions, SlurmSection
from hpctrain.slurm import exits, job
from hpctrain.slurm.facts import Facts
from hpctrain.slurm.lint import lint
from hpctrain.slurm.render import ArraySpec, JobSpec, ScriptSpec, render_script

GOLDEN = Path(__file__).parent / "golden"
CONFIG = 'experiment = "script:train.py"\n\n[run]\ndir = "/shared/runs/train"\n'
SETTINGS = 'experiment = "script:train.py"\n\n[slurm]\nnodes = 2\n\n[run]\ndir = "/shared/runs/train"\n'


def spec(script: ScriptSpec | None = None, nproc_per_node: int = 0, **slurm) -> JobSpec:
    return JobSpec(
        slurm=SlurmSection(**slurm), job_name="train", experiment="script:train.py", config_toml=CONFIG,
        run_dir="/shared/runs/train", workdir="/home/user/project", python="/home/user/venv/bin/python",
        venv="/home/user/venv", warning_signal="SIGUSR2", version="0.1.0", nproc_per_node=nproc_per_node,
        script=script or ScriptSpec(program=("train.py",), args=("--lr", "3e-4", "--note", "it's mine"),
                                    settings_toml=SETTINGS),
    )


def array(**slurm) -> JobSpec:
    points = ("p000_lr=1e-4", "p001_lr=3e-4")
    return dataclasses.replace(
        spec(ScriptSpec(program=("-m", "pkg.train"), point_args=(("--epochs", "2", "--lr", "1e-4"),
                                                                   ("--epochs", "2", "--lr", "3e-4")),
                        requeue_codes=(75, 76)), **slurm),
        run_dir="/shared/sweeps/train", config_toml="", experiment="script:-m pkg.train",
        array=ArraySpec(sweep_dir="/shared/sweeps/train", points=points, max_parallel=1))


SHAPES = {
    "script_single_node": lambda: spec(nodes=1, gpus_per_node=4, partition="gpu", time="1-00:00:00"),
    "script_multi_node": lambda: spec(
        ScriptSpec(program=("train.py",), args=("--epochs", "10"), settings_toml=SETTINGS, requeue_codes=(75, 76)),
        nproc_per_node=2, nodes=2, gpus_per_node=2, gpus=False, cpus_per_task=2),
    "script_sweep_array": lambda: array(nodes=1, gpus_per_node=2),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_script_jobs_rendered_script_matches_its_golden_file(shape):
    text = render_script(SHAPES[shape]())
    path = GOLDEN / f"slurm_{shape}.sh"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"render changed; if intended, UPDATE_GOLDEN=1 and review {path}"
    proc = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


def test_the_script_runs_under_torchrun_on_every_node_not_hpctrain():
    text = render_script(SHAPES["script_multi_node"]())
    launch = next(line for line in text.splitlines() if line.startswith("LAUNCH=("))
    assert "-m hpctrain.launch --nnodes=\"$SLURM_JOB_NUM_NODES\" --nproc-per-node=2 --rdzv-backend=c10d" in launch
    assert launch.endswith(" train.py --epochs 10)") and " -m hpctrain " not in launch
    assert 'export HPCTRAIN_SETTINGS="$RUN_DIR/settings.toml"' in text
    assert "#SBATCH --signal=B:USR2@120" in text and "#SBATCH --requeue" in text


# ---- the script run in bash, with stub Slurm commands ----------------------------------------------------------

STUB = """#!/bin/bash
# records its arguments, one per line, for the test (appended: scontrol is called several times)
{{ printf '%s\\n' "---"; for a in "$@"; do printf '%s\\n' "$a"; done; }} >> "{out}/$(basename "$0").args"
"""
SRUN = STUB + """env > "{out}/srun.env"
# the node launchers' records, as hpctrain's launcher writes them, then srun's own exit code
cp "{records}"/node*.json "$HPCTRAIN_EXITS_DIR"/ 2> /dev/null || true
exit "${{STUB_RC:-0}}"
"""
SCONTROL = STUB + """case "$1 $2" in
  "show hostnames") printf 'node1\\nnode2\\n' ;;
  "show config") printf 'ProctrackType           = %s\\n' "${{STUB_PROCTRACK:-proctrack/linuxproc}}" ;;
esac
"""


def run_job(tmp_path: Path, s: JobSpec, codes: list[int], rc: int = 0, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the rendered script in bash: srun copies one record per node (exit ``codes``, written with the launcher's
    writer) into the job's exits folder and exits ``rc``."""
    out, bin_dir, records = tmp_path / "out", tmp_path / "bin", tmp_path / "records"
    for d in (out, bin_dir, records):
        d.mkdir(exist_ok=True)
    for node, code in enumerate(codes):
        outcome = "requeue" if code == 75 else "completed" if code == 0 else "failed"
        exits.write_record(records, node, {"exit_code": code, "outcome": outcome, "host": f"node{node + 1}"})
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("sstat", STUB), ("sacct", STUB)):
        (bin_dir / name).write_text(text.format(out=out, records=records))
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(render_script(s))
    full = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_JOB_NUM_NODES": str(len(codes)), "HOME": str(tmp_path), "STUB_RC": str(rc), **env}
    proc = subprocess.run(["bash", str(script)], env=full, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    return proc, out


def requeues(out: Path) -> list[str]:
    calls = (out / "scontrol.args").read_text().split("---\n")
    return [c.split()[1] for c in calls if c.startswith("requeue")]


HOSTILE = "a b'c\"d $(touch {marker}) `touch {marker}` ;touch {marker}"


def hostile_spec(tmp_path: Path, **script) -> JobSpec:
    marker = tmp_path / "INJECTED"
    hostile = HOSTILE.format(marker=marker)
    run_dir = tmp_path / f"run dir {HOSTILE.format(marker='INJECTED_BY_RUN_DIR')}"
    program = script.pop("program", (f"{hostile}.py",))
    return dataclasses.replace(
        spec(ScriptSpec(program=program, args=("--note", hostile, "--", "-m", "$HOME"), settings_toml=SETTINGS,
                        **script), nodes=2, gpus_per_node=2, gpus=False, cpus_per_task=2, monitor_every_s=0),
        job_name=hostile, run_dir=str(run_dir), workdir=str(tmp_path), python=hostile, venv="")


def test_hostile_script_paths_and_arguments_reach_the_step_literally(tmp_path):
    s = hostile_spec(tmp_path)
    proc, out = run_job(tmp_path, s, [0, 0])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "INJECTED").exists() and not (tmp_path / "INJECTED_BY_RUN_DIR").exists()
    args = (out / "srun.args").read_text().split("---\n")[1].splitlines()
    hostile = HOSTILE.format(marker=tmp_path / "INJECTED")
    assert args[-6:] == [f"{hostile}.py", "--note", hostile, "--", "-m", "$HOME"]  # the script's own words, as given
    assert args.count(hostile) == 2  # the python path too
    run_dir = Path(s.run_dir)
    assert (run_dir / "settings.toml").read_text() == SETTINGS and (run_dir / "config.toml").read_text() == CONFIG
    env = (out / "srun.env").read_text().splitlines()
    assert f"HPCTRAIN_SETTINGS={run_dir}/settings.toml" in env
    assert f"HPCTRAIN_EXITS_DIR={run_dir}/slurm/exits/42.0" in env
    assert "HPCTRAIN_FORWARD_SIGNALS=0" in env  # proctrack/linuxproc signals every process of the step itself
    assert requeues(out) == []


@pytest.mark.parametrize("codes, rc, expected, requeued", [
    ([75, 75], 0, 75, True),      # every node's ranks asked: requeued, once
    ([75, 1], 1, 1, False),       # a node failed: the job fails, whatever the others asked
    ([75, 0], 0, 1, False),       # some nodes asked, others finished: the ranks disagree, a failure
    ([75], 0, 1, False),          # a node wrote no record (killed before it could): not requeued
    ([0, 0], 0, 0, False),
    ([76, 75], 0, 75, True),      # any of the requeue codes (fault.requeue_exit_codes)
])
def test_the_batch_shell_requeues_only_when_every_node_asked_for_it(tmp_path, codes, rc, expected, requeued):
    s = hostile_spec(tmp_path, requeue_codes=(75, 76))
    proc, out = run_job(tmp_path, s, codes, rc, SLURM_JOB_NUM_NODES="2")
    assert proc.returncode == expected, proc.stdout + proc.stderr
    assert requeues(out) == (["42"] if requeued else [])
    assert f"hpctrain: job step ended with exit code {expected} at" in proc.stdout


def test_no_requeue_when_the_config_says_so_and_signals_forwarded_where_slurm_does_not(tmp_path):
    s = hostile_spec(tmp_path, requeue=False)
    proc, out = run_job(tmp_path, s, [75, 75], STUB_PROCTRACK="proctrack/pgid")
    assert proc.returncode == 75 and requeues(out) == []  # it asked; fault.requeue=false: the job just ends so
    assert "HPCTRAIN_FORWARD_SIGNALS=1" in (out / "srun.env").read_text().splitlines()


def test_a_sweep_point_gets_its_own_arguments_settings_and_requeue_id(tmp_path):
    sweep = tmp_path / "sweep dir"
    s = dataclasses.replace(array(nodes=1, gpus_per_node=2, gpus=False, cpus_per_task=2, monitor_every_s=0),
                            run_dir=str(sweep), workdir=str(tmp_path), venv="", python="python3",
                            array=ArraySpec(sweep_dir=str(sweep), points=("p000_lr=1e-4", "p001_lr=3e-4")))
    for folder, text in (("configs", CONFIG), ("settings", SETTINGS)):
        (sweep / folder).mkdir(parents=True)
        (sweep / folder / "p001_lr=3e-4.toml").write_text(text)
    proc, out = run_job(tmp_path, s, [75], SLURM_ARRAY_JOB_ID="40", SLURM_ARRAY_TASK_ID="1")
    assert proc.returncode == 75, proc.stdout + proc.stderr
    assert (out / "srun.args").read_text().split("---\n")[1].splitlines()[-6:] == \
        ["-m", "pkg.train", "--epochs", "2", "--lr", "3e-4"]
    point = sweep / "p001_lr=3e-4"
    assert (point / "settings.toml").read_text() == SETTINGS and (point / "config.toml").read_text() == CONFIG
    assert requeues(out) == ["40_1"]  # its own array task, never the whole array
    assert f"HPCTRAIN_EXITS_DIR={point}/slurm/exits/40_1.0" in (out / "srun.env").read_text().splitlines()


# ---- the lint ---------------------------------------------------------------------------------------------------

def script_findings(workdir: Path, *overrides: str, path: str = "train.py", nproc: int = 0, shared: bool = True):
    """The lint of a script job submitted from ``workdir``, the script's facts as gathered there; ``shared``: as if
    that folder were on the cluster's shared filesystem (pytest's folders are under /tmp)."""
    from hpctrain.slurm.facts import gather_facts

    cfg = load_config(f"script:{path}", NoModelOptions, overrides=["run.dir=/shared/runs/x", *overrides])
    s = dataclasses.replace(job.job_spec(cfg, workdir, script_args=("--lr", "1"), nproc_per_node=nproc),
                            python="/usr/bin/python3", venv="")
    found = gather_facts(cfg, s, ())
    script = {"script_problem": found.script_problem, "script_file": found.script_file, "script_fs": found.script_fs}
    if shared and found.script_file:
        script.update(script_file=found.script_file.replace(str(workdir), "/shared/project"), script_fs="nfs4")
    return lint(cfg, s, Facts(run_dir_fs="nfs4", existing=frozenset({"/usr/bin/python3"}), **script))


def test_the_lint_checks_the_script_and_the_process_shape(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    base = ("slurm.nodes=2", "slurm.gpus_per_node=2")
    # a sensible script job: no batch, worker or checkpoint findings of hpctrain's training (the script owns those)
    assert [(f.level, f.key) for f in script_findings(tmp_path, *base, "data.num_workers=64")] == []
    missing = script_findings(tmp_path, *base, path="nope.py")
    assert [(f.level, f.key) for f in missing] == [("error", "--script")]
    assert "/shared/project/nope.py does not exist" in missing[0].message and str(tmp_path) in missing[0].hint
    (tmp_path / "pkg").mkdir()
    assert [f.key for f in script_findings(tmp_path, *base, path="pkg")] == ["--script"]  # a directory
    shape = script_findings(tmp_path, "slurm.nodes=2", "slurm.gpus_per_node=4", "slurm.gpu_type=a100", nproc=2)
    assert [(f.level, f.key) for f in shape] == [("error", "--nproc-per-node")]
    assert "2 processes per node, but the job asks for --gres=gpu:a100:4" in shape[0].message
    extra = script_findings(tmp_path, *base, "slurm.extra_sbatch=['--gres=gpu:8']")
    assert [(f.level, f.key) for f in extra] == [("warning", "slurm.extra_sbatch")]
    assert [f.key for f in script_findings(tmp_path, *base, "slurm.time=30", "slurm.signal_lead_s=0")] == \
        ["fault.warning_signal"]  # the time limit still matters; no ckpt.every_minutes finding for a script


def test_the_lint_warns_about_a_script_the_compute_nodes_may_not_see(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    (local / "train.py").write_text("")
    found = script_findings(local, "slurm.nodes=2", shared=False)  # pytest's folders are under /tmp
    assert [(f.level, f.key) for f in found] == [("warning", "--script")] and "/tmp" in found[0].message
    unreadable = local / "secret.py"
    unreadable.write_text("")
    unreadable.chmod(0)
    if os.geteuid() != 0:  # root reads anything
        assert [f.level for f in script_findings(local, path="secret.py", shared=False)] == ["error"]


def test_a_module_that_is_not_found_is_a_warning_one_that_is_is_fine(tmp_path):
    assert [f.key for f in script_findings(tmp_path, path="-m nosuch.pkg")] == ["--module"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "__init__.py").write_text("")
    assert script_findings(tmp_path, path="-m mine.train") == []
    assert script_findings(tmp_path, path="-m json.tool") == []  # installed


# ---- the node records ----------------------------------------------------------------------------------------------

def test_status_names_the_first_failure_of_the_latest_run(tmp_path):
    run_dir = tmp_path / "run"
    first, second = run_dir / exits.EXITS / "42.0", run_dir / exits.EXITS / "42.1"
    exits.write_record(first, 0, {"exit_code": 75, "outcome": "requeue", "host": "node1"})
    exits.write_record(second, 0, {"exit_code": 1, "outcome": "failed", "host": "node1", "time": 12.0,
                                   "how": "its launcher (torchrun) failed", "error": "RendezvousConnectionError: x",
                                   "consequence": True})
    exits.write_record(second, 1, {"exit_code": 1, "outcome": "failed", "host": "node2", "time": 13.0, "rank": 3,
                                   "local_rank": 1, "how": "exit code 1", "error": "ValueError: bad batch",
                                   "consequence": False})
    (run_dir / exits.EXITS / "43.0").mkdir()  # another job of the run dir
    assert json.loads(exits.record_path(second, 1).read_text())["exit_code"] == 1
    line = exits.failure_line(exits.latest_records(run_dir, "42"))
    assert line == "failed: rank 3 (local rank 1) on node2, exit code 1: ValueError: bad batch"
    assert exits.failure_line(exits.latest_records(run_dir, "43")) == ""
    assert exits.latest_records(run_dir, "4") == []  # 4 is not 42
