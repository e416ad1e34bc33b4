"""`hpctrain sweep submit`: a grid as one Slurm job array (the single-run render, lint and submit code with an
array spec), or with --local one run after another here (the status of the points: sweep/status.py)."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hpctrain.atomic import atomic_write_text
from hpctrain.errors import UserError
from hpctrain.slurm import facts, job, lint, render
from hpctrain.sweep.spec import SWEEP_FILE, SweepSpec, build_sweep, check_same_sweep, write_sweep
from hpctrain.sweep.status import STATUS_DIR, collect_status, is_error


@dataclass(frozen=True)
class SubmitRequest:
    experiment: str
    config_file: str | None
    overrides: tuple[str, ...]
    grid: tuple[str, ...]
    sweep_dir: str
    max_parallel: int = 0
    local: bool = False
    nproc_per_node: int = 1
    dry_run: bool = False
    allow_large: bool = False
    force: bool = False


def submit_command(req: SubmitRequest) -> int:
    if req.max_parallel < 0:
        raise UserError(f"--max-parallel {req.max_parallel} is negative", "give how many points may run at once, "
                        "or 0 for no limit.")
    plan, configs = build_sweep(req.experiment, req.config_file, req.overrides, list(req.grid), req.sweep_dir,
                               req.allow_large)
    print(point_table(plan), file=sys.stderr)
    going_on = (plan.sweep_dir / SWEEP_FILE).exists()
    if going_on:  # another grid or settings in a used dir: refused whatever state its points are in
        check_same_sweep(plan, configs)
    if req.local:
        if req.dry_run:
            return 0
        if going_on:
            _refuse_live_array(plan, req.force)
        write_sweep(plan, configs)
        return run_locally(plan, req.nproc_per_node)
    todo = _unfinished(plan) if going_on else ()
    if todo == ("none",):
        print(f"hpctrain: every point of {plan.sweep_dir} is done; nothing to submit "
              f"({shlex.join(['hpctrain', 'report', str(plan.sweep_dir)])})", file=sys.stderr)
        return 0
    # A point that trains here (--local, a plain `hpctrain train`) or in another job would get a second writer.
    job.refuse_held_run_dirs([Path(configs[p.name].run_dir) for p in plan.points])
    spec = array_spec(plan, configs, req.max_parallel, tuple(int(i) for i in todo))
    if req.dry_run:
        print(render.render_script(spec), end="")
        return 0
    findings = _lint_points(plan, configs, spec)
    errors = [f for f in findings if f.level == "error"]
    if errors and not req.force:
        raise UserError(f"not submitted: {len(errors)} error(s) in the job (listed above)",
                        "fix them, or submit anyway with --force if you know better than the check.")
    write_sweep(plan, configs)
    job_id = job.submit(render.render_script(spec), plan.sweep_dir)
    print(job_id)
    print(f"hpctrain: submitted job array {job_id} ({len(plan.points)} points"
          + (f", at most {req.max_parallel} at once" if req.max_parallel else "") + f"); sweep dir {plan.sweep_dir}\n"
          f"  {shlex.join(['hpctrain', 'sweep', 'status', str(plan.sweep_dir)])}\n"
          f"  {shlex.join(['hpctrain', 'report', str(plan.sweep_dir)])}", file=sys.stderr)
    return 0


def _unfinished(plan: SweepSpec) -> tuple[str, ...]:
    """Going on with a sweep submitted before: refused while its array is still queued or running (two trainings
    would write one run dir); else the indices of the points not done (("none",) when all are)."""
    _refuse_live_array(plan)
    states = collect_status(plan)
    todo = tuple(str(p.index) for p, s in zip(plan.points, states) if s.state != "done")
    return todo or ("none",)


def _refuse_live_array(plan: SweepSpec, force: bool = False) -> None:
    """Refused while the sweep's last array job is queued or running: its tasks and this submit (an array, or
    --local) would train the same run dirs at once. Without squeue here (--local on another machine) the array
    cannot be checked: refused unless force."""
    jobs = job.recorded_jobs(plan.sweep_dir)
    if not jobs:
        return
    try:
        proc = job.run_slurm(["squeue", "--noheader", "--array", "--jobs", jobs[-1], "--format=%i"])
    except UserError as err:
        if force:
            return
        raise UserError(f"the sweep in {plan.sweep_dir} was submitted to Slurm as array job {jobs[-1]}, and "
                        f"{err.args[0] if err.args else err}, so whether it still runs cannot be checked",
                        f"check on the cluster that array job {jobs[-1]} has left the queue (squeue -j {jobs[-1]}), "
                        "then pass --force to run the points here.") from None
    if proc.returncode == 0 and proc.stdout.strip():
        raise UserError(f"the sweep in {plan.sweep_dir} still has array job {jobs[-1]} queued or running",
                        f"wait for it ({shlex.join(['hpctrain', 'sweep', 'status', str(plan.sweep_dir)])}), or "
                        "cancel it first "
                        f"(hpctrain slurm cancel {jobs[-1]}); then the same command goes on with the unfinished "
                        "points.")


def point_table(plan: SweepSpec) -> str:
    keys = [a.key for a in plan.axes]
    lines = [f"sweep {plan.sweep_dir}: {plan.experiment}, {len(plan.points)} point(s)",
             "| point | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    lines += ["| " + p.name.split("_", 1)[0] + " | " + " | ".join(v for _, v in p.settings) + " |" for p in plan.points]
    return "\n".join(lines)


def array_spec(plan: SweepSpec, configs: dict, max_parallel: int, indices: tuple[int, ...] = ()) -> render.JobSpec:
    """The single-run spec of the first point, made an array over all of them (they share the [slurm] section:
    a sweep cannot vary slurm.* keys), its logs and records in the sweep dir."""
    first = configs[plan.points[0].name]
    spec = job.job_spec(first)
    array = render.ArraySpec(sweep_dir=str(plan.sweep_dir), points=tuple(p.name for p in plan.points),
                             max_parallel=max_parallel, indices=indices)
    name = first.slurm.job_name or f"sweep-{plan.sweep_dir.name}"
    return dataclasses.replace(spec, job_name=name, run_dir=str(plan.sweep_dir), config_toml="", array=array)


def _lint_points(plan: SweepSpec, configs: dict, spec: render.JobSpec) -> list[lint.Finding]:
    """Every point's config linted against the cluster (the facts gathered once); a finding printed once, with the
    points it applies to when not all."""
    found = facts.gather_facts(configs[plan.points[0].name], spec)
    where: dict[lint.Finding, list[str]] = {}
    for p in plan.points:
        for f in lint.lint(configs[p.name], spec, found):
            where.setdefault(f, []).append(p.name.split("_", 1)[0])
    for f, names in where.items():
        text = f.format()
        print(text if len(names) == len(plan.points) else f"{text}\n        (points {', '.join(names)})",
              file=sys.stderr)
    return list(where)


# ---- local -----------------------------------------------------------------------------------------------------

def run_locally(plan: SweepSpec, nproc_per_node: int) -> int:
    """Each point in turn with `hpctrain train` (a point already finished resumes, finds nothing to do, and is
    quick); a failed point is recorded and the next one runs. Ctrl-C stops the sweep after the running point has
    saved its checkpoint: the same command goes on from there."""
    failed = 0
    for point in plan.points:
        print(f"hpctrain: sweep point {point.index + 1}/{len(plan.points)}: {point.name}", file=sys.stderr, flush=True)
        args = [sys.executable, "-m", "hpctrain", "train", plan.experiment, "--config", str(plan.config_path(point))]
        if nproc_per_node > 1:
            args += ["--nproc-per-node", str(nproc_per_node)]
        _record(plan, point.name, "running", None, "")
        code, error = _run_point(args)
        interrupted = code in (130, -2)
        _record(plan, point.name, "done" if code == 0 else "stopped" if interrupted else "failed", code, error)
        if interrupted:  # Ctrl-C: the point saved and stopped; so does the sweep
            print(f"hpctrain: sweep interrupted at {point.name}; run the same command again to go on",
                  file=sys.stderr)
            return 130
        failed += code != 0
    print(f"hpctrain: sweep done: {len(plan.points) - failed} point(s) finished, {failed} failed; "
          f"{shlex.join(['hpctrain', 'report', str(plan.sweep_dir)])}", file=sys.stderr)
    return 1 if failed else 0


def _record(plan: SweepSpec, name: str, state: str, code: int | None, error: str) -> None:
    (plan.sweep_dir / STATUS_DIR).mkdir(exist_ok=True)
    record = {"state": state, "exit_code": code, "error": error, "time": time.time()}
    atomic_write_text(plan.sweep_dir / STATUS_DIR / f"{name}.json", json.dumps(record) + "\n")


def _run_point(args: list[str]) -> tuple[int, str]:
    """Run one point, its output passed through; (exit code, its last error line or ''). A thread reads its stderr
    to the end, after a Ctrl-C too: a point that writes more than a pipe holds (64 KiB) while it shuts down would
    otherwise block on the full pipe, and the sweep waiting for it would never end."""
    proc = subprocess.Popen(args, stdout=None, stderr=subprocess.PIPE, text=True, errors="replace")
    last_error = [""]
    reader = threading.Thread(target=_pass_through, args=(proc.stderr, last_error), daemon=True)
    reader.start()
    interrupted = False
    while True:
        try:
            code = proc.wait()
            reader.join()
            break
        except KeyboardInterrupt:  # the point got the same SIGINT: wait for its checkpoint (after a second one too)
            interrupted = True
    return (130 if interrupted and code == 0 else code), last_error[0]


def _pass_through(stream, last_error: list[str]) -> None:
    for line in stream:
        sys.stderr.write(line)
        if is_error(line):
            last_error[0] = line.strip()
