"""Build the job spec from a resolved config, and wrap sbatch/squeue/scontrol/scancel.

The wrappers add what the raw commands lack: the run dir as the handle (its job ids are
recorded in RUN_DIR/slurm/jobs.jsonl), the training progress next to the Slurm state, and
messages that say what to do when a command is missing or fails.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hpctrain import __version__
from hpctrain.atomic import atomic_write_text
from hpctrain.config.load import config_to_toml
from hpctrain.config.schema import RunConfig
from hpctrain.errors import UserError
from hpctrain.slurm.render import JobSpec, ScriptSpec

JOBS_FILE = "slurm/jobs.jsonl"
SIGNAL_ANSWER_S = 4.0
"""How long scancel may take to signal a job: its first retry comes after 5 s (see cancel)."""


def job_spec(cfg: RunConfig, workdir: Path | None = None, *, script_args: tuple[str, ...] = (),
             settings_toml: str = "", nproc_per_node: int = 0) -> JobSpec:
    """The spec for this config, run from ``workdir`` (default: here) with this Python environment. A script job's
    (cfg.script): its arguments, the settings the user gave (config/load.settings_toml) and --nproc-per-node."""
    run_dir = Path(cfg.run_dir).resolve()
    if "%" in str(run_dir):
        raise UserError(f"run.dir {run_dir} contains '%', which Slurm would read as a file-name pattern",
                        "choose a run dir without '%'.")
    # The embedded config names the run dir absolutely: the job must not depend on where it starts.
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(run_dir)))
    s = cfg.slurm
    in_venv = sys.prefix != sys.base_prefix and Path(sys.prefix, "bin", "activate").exists()
    return JobSpec(
        slurm=s,
        job_name=s.job_name or cfg.run_name,
        experiment=cfg.experiment,
        config_toml=config_to_toml(cfg),
        run_dir=str(run_dir),
        workdir=str((workdir or Path.cwd()).resolve()),
        python=s.python or sys.executable,
        venv=sys.prefix if in_venv and not s.python else "",
        warning_signal=cfg.fault.warning_signal,
        version=__version__,
        script=script_spec(cfg, script_args, settings_toml),
        nproc_per_node=nproc_per_node,
    )


def script_spec(cfg: RunConfig, args: tuple[str, ...], settings_toml: str) -> ScriptSpec | None:
    """A script job's program, arguments, settings and requeue codes (fault.exit_code first); None for an
    experiment."""
    if cfg.script is None:
        return None
    f = cfg.fault
    return ScriptSpec(program=tuple(cfg.script.python_args), args=tuple(args), settings_toml=settings_toml,
                      requeue_codes=(f.exit_code, *sorted(f.requeue_codes - {f.exit_code})),
                      requeue=f.requeue and cfg.slurm.requeue)


def slurm_command(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise UserError(
            f"'{name}' was not found: this machine has no Slurm client commands",
            "run this on a login node of your cluster (or load its Slurm module); "
            "'hpctrain slurm render' works anywhere and prints the script.",
        )
    return path


class SlurmUnanswered(UserError):
    """A Slurm command failed or timed out without an answer about the job (the controller busy or down): it says
    nothing about whether the job runs."""


def run_slurm(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [slurm_command(args[0])] + args[1:]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SlurmUnanswered(f"'{shlex.join(args)}' did not answer in {timeout:.0f} s",
                              "the Slurm controller may be down or overloaded; try again, or ask your admins.") from None


def submit(script: str, run_dir: Path) -> str:
    """Write the script into the run dir, sbatch it, record the job id; returns the job id."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)  # Slurm does not create the --output directory
    (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    path = run_dir / "slurm" / "job.sh"
    atomic_write_text(path, script)
    path.chmod(0o755)
    proc = run_slurm(["sbatch", "--parsable", str(path)])
    if proc.returncode != 0:
        raise UserError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}",
                        f"the script is in {path}; fix the [slurm] settings named above and submit again.")
    job_id = proc.stdout.strip().split(";")[0]
    shutil.copyfile(path, run_dir / "slurm" / f"job_{job_id}.sh")
    with open(run_dir / JOBS_FILE, "a") as f:
        f.write(json.dumps({"job_id": job_id, "submitted": time.time(), "script": f"slurm/job_{job_id}.sh"}) + "\n")
    return job_id


def recorded_jobs(run_dir: Path) -> list[str]:
    path = run_dir / JOBS_FILE
    if not path.exists():
        return []
    return [json.loads(line)["job_id"] for line in path.read_text().splitlines() if line.strip()]


ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                   "DEADLINE", "PREEMPTED", "REVOKED"})
"""Slurm's job states after which a job no longer trains; any other (pending, running, requeued, held, suspended,
completing) may still write its run dir."""


def live_recorded_job(run_dir: Path) -> tuple[str, str] | None:
    """(job id, state) of a job submitted from this run dir that is still queued or running; None when none is.
    SlurmUnanswered when Slurm could not say (that is not 'ended')."""
    for job_id in reversed(recorded_jobs(run_dir)):
        state = job_fields(job_id).get("JobState", "")  # {} when Slurm forgot it: ended long ago
        if state and state not in ENDED:
            return job_id, state
    return None


def job_liveness(job_id: str) -> str:
    """'ended' (an ended state, or a job Slurm no longer knows), 'suspended', or 'live' (queued, running,
    completing: it may still write). Raises UserError when Slurm cannot be asked or does not answer."""
    state = job_fields(job_id).get("JobState", "")
    if not state or state in ENDED:
        return "ended"
    return "suspended" if state == "SUSPENDED" else "live"


def resolve_target(target: str) -> tuple[str, Path | None]:
    """(job id, run dir or None) for a run dir, a job id, or an array task's id (ARRAY_TASK, e.g. 812_3: one point
    of a sweep)."""
    if re.fullmatch(r"\d+(_\d+)?", target):
        return target, None
    run_dir = Path(target)
    if not run_dir.is_dir():
        raise UserError(f"{target!r} is neither a job id nor a run directory",
                        "pass the run dir you submitted from (run.dir) or the job id that submit printed.")
    jobs = recorded_jobs(run_dir)
    if not jobs:
        raise UserError(f"no Slurm job was submitted from {run_dir} (no {JOBS_FILE})",
                        "submit with 'hpctrain slurm submit EXPERIMENT run.dir=...', or pass a job id.")
    return jobs[-1], run_dir


FORGOTTEN = "Invalid job id specified"
"""scontrol's answer for a job it does not know (ended before MinJobAge, or never existed)."""


def job_fields(job_id: str) -> dict[str, str]:
    """scontrol's view of a job (pending, running, or recently ended); {} when Slurm forgot it ("Invalid job id
    specified"). Any other failure (a socket timeout, the controller down) says nothing about the job:
    SlurmUnanswered."""
    proc = run_slurm(["scontrol", "show", "job", "--oneliner", job_id])
    if proc.returncode == 0:
        return parse_scontrol_fields(proc.stdout)
    said = (proc.stderr.strip() or proc.stdout.strip())
    if FORGOTTEN.lower() in said.lower():
        return {}
    raise SlurmUnanswered(f"'scontrol show job {job_id}' failed: {said or f'exit code {proc.returncode}'}",
                          "the Slurm controller may be busy or down; try again, or ask your admins.")


_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")


def parse_scontrol_fields(text: str) -> dict[str, str]:
    """KEY=VALUE pairs of one ``scontrol show --oneliner`` line. Values may contain spaces (a job name),
    so a value runs up to the next `` KEY=``; the first occurrence of a key wins."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    matches = list(_KEY.finditer(line))
    fields: dict[str, str] = {}
    for m, nxt in zip(matches, matches[1:] + [None]):
        value = line[m.end(): nxt.start() if nxt else len(line)]
        fields.setdefault(m.group(1), value.strip())
    return fields


def accounting_state(job_id: str) -> dict[str, str]:
    """sacct's record of an ended job, when accounting is configured."""
    proc = run_slurm(["sacct", "--noheader", "--parsable2", "--format=State,ExitCode,Elapsed,NodeList",
                      "-X", "-j", job_id])
    line = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""
    if not line:
        return {}
    state, exit_code, elapsed, nodes = (line.split("|") + ["", "", "", ""])[:4]
    return {"JobState": state, "ExitCode": exit_code, "RunTime": elapsed, "NodeList": nodes}


def job_state(job_id: str) -> dict[str, str]:
    """scontrol's view of the job, else (forgotten, or the controller did not answer: a busy controller, or
    PrivateData's refusal) sacct's record; {} when neither has one."""
    try:
        fields = job_fields(job_id)
    except SlurmUnanswered as err:
        print(f"hpctrain: {err.args[0]}; asking sacct instead", file=sys.stderr)
        fields = {}
    return fields or accounting_state(job_id)


def cancel(job_id: str, signal: str = "") -> None:
    """scancel; with a signal, send it to the batch shell only (its trap passes it to every task, as Slurm's
    --signal=B:SIG@LEAD does before the time limit)."""
    args = ["scancel"] + ([f"--signal={signal}", "--batch"] if signal else []) + [job_id]
    if signal and "_" in job_id:
        # Signalling an array task's batch shell, Slurm 22.05 delivered the signal and still answered "Job can not be
        # altered now, try again later"; scancel then retries (after 5, 6, 7 s ...) until the task, requeued by the
        # signal, runs again, and signals it a second time (seen on the test cluster: a second preemption). One
        # request only: scancel is stopped before its first retry.
        try:
            proc = subprocess.run([slurm_command("scancel")] + args[1:], capture_output=True, text=True,
                                  timeout=SIGNAL_ANSWER_S)
        except subprocess.TimeoutExpired:
            print(f"hpctrain: scancel got no final answer for {job_id} within {SIGNAL_ANSWER_S:g} s (Slurm 22.05 "
                  "answers an array task's signal with 'try again later' after delivering it); stopped before its retry, so "
                  "that a task it requeued is not signalled again. Check the task's log for 'got SIG...' and send it "
                  "again if it is not there.", file=sys.stderr)
            return
    else:
        proc = run_slurm(args)
    if proc.returncode != 0:
        raise UserError(f"scancel failed: {proc.stderr.strip()}", "check the job id with 'hpctrain slurm status'.")


def log_files(job_id: str, run_dir: Path | None) -> list[Path]:
    if run_dir is not None:
        found = sorted((run_dir / "logs").glob(f"*_{job_id}.out"))
        if found:
            return found
    try:
        out = job_fields(job_id).get("StdOut", "")
    except SlurmUnanswered as err:  # where the log went is not known: none found, and why
        print(f"hpctrain: Slurm did not say where job {job_id} writes its log ({err.args[0]})", file=sys.stderr)
        return []
    return [Path(out)] if out and Path(out).exists() else []
