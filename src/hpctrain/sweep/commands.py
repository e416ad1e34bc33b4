"""`hpctrain sweep submit|status`: a grid as one Slurm job array (the single-run render, lint and submit code with an
array spec), or with --local one run after another here; the status of every point from Slurm and the run dirs."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpctrain.atomic import atomic_write_text
from hpctrain.errors import UserError
from hpctrain.metrics.records import metric_values, read_metrics
from hpctrain.slurm import facts, job, lint, render
from hpctrain.sweep.plan import SweepPlan, build_plan, read_plan, write_plan

STATUS_DIR = "status"
"""SWEEP_DIR/status/NAME.json: how a local run of a point ended (state, exit code, its error line)."""


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
    plan, configs = build_plan(req.experiment, req.config_file, req.overrides, list(req.grid), req.sweep_dir,
                               req.allow_large)
    print(point_table(plan), file=sys.stderr)
    if req.local:
        if req.dry_run:
            return 0
        write_plan(plan, configs)
        return run_locally(plan, req.nproc_per_node)
    todo = _unfinished(plan) if (plan.sweep_dir / "sweep.toml").exists() else ()
    if todo == ("none",):
        print(f"hpctrain: every point of {plan.sweep_dir} is done; nothing to submit (hpctrain report "
              f"{plan.sweep_dir})", file=sys.stderr)
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
    write_plan(plan, configs)
    job_id = job.submit(render.render_script(spec), plan.sweep_dir)
    print(job_id)
    print(f"hpctrain: submitted job array {job_id} ({len(plan.points)} points"
          + (f", at most {req.max_parallel} at once" if req.max_parallel else "") + f"); sweep dir {plan.sweep_dir}\n"
          f"  hpctrain sweep status {plan.sweep_dir}\n  hpctrain report {plan.sweep_dir}", file=sys.stderr)
    return 0


def _unfinished(plan: SweepPlan) -> tuple[str, ...]:
    """Going on with a sweep submitted before: refused while its array is still queued or running (two trainings
    would write one run dir); else the indices of the points not done (("none",) when all are)."""
    jobs = job.recorded_jobs(plan.sweep_dir)
    if jobs:
        proc = job.run_slurm(["squeue", "--noheader", "--array", "--jobs", jobs[-1], "--format=%i"])
        if proc.returncode == 0 and proc.stdout.strip():
            raise UserError(f"the sweep in {plan.sweep_dir} still has array job {jobs[-1]} queued or running",
                            f"wait for it (hpctrain sweep status {plan.sweep_dir}), or cancel it first "
                            f"(hpctrain slurm cancel {jobs[-1]}); then the same command submits the unfinished points.")
    states = collect_status(plan)
    todo = tuple(str(p.index) for p, s in zip(plan.points, states) if s.state != "done")
    return todo or ("none",)


def point_table(plan: SweepPlan) -> str:
    keys = [a.key for a in plan.axes]
    lines = [f"sweep {plan.sweep_dir}: {plan.experiment}, {len(plan.points)} point(s)",
             "| point | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    lines += ["| " + p.name.split("_", 1)[0] + " | " + " | ".join(v for _, v in p.settings) + " |" for p in plan.points]
    return "\n".join(lines)


def array_spec(plan: SweepPlan, configs: dict, max_parallel: int, indices: tuple[int, ...] = ()) -> render.JobSpec:
    """The single-run spec of the first point, made an array over all of them (they share the [slurm] section:
    a sweep cannot vary slurm.* keys), its logs and records in the sweep dir."""
    first = configs[plan.points[0].name]
    spec = job.job_spec(first)
    array = render.ArraySpec(sweep_dir=str(plan.sweep_dir), points=tuple(p.name for p in plan.points),
                             max_parallel=max_parallel, indices=indices)
    name = first.slurm.job_name or f"sweep-{plan.sweep_dir.name}"
    return dataclasses.replace(spec, job_name=name, run_dir=str(plan.sweep_dir), config_toml="", array=array)


def _lint_points(plan: SweepPlan, configs: dict, spec: render.JobSpec) -> list[lint.Finding]:
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

def run_locally(plan: SweepPlan, nproc_per_node: int) -> int:
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
          f"hpctrain report {plan.sweep_dir}", file=sys.stderr)
    return 1 if failed else 0


def _record(plan: SweepPlan, name: str, state: str, code: int | None, error: str) -> None:
    (plan.sweep_dir / STATUS_DIR).mkdir(exist_ok=True)
    record = {"state": state, "exit_code": code, "error": error, "time": time.time()}
    atomic_write_text(plan.sweep_dir / STATUS_DIR / f"{name}.json", json.dumps(record) + "\n")


def _run_point(args: list[str]) -> tuple[int, str]:
    """Run one point, its output passed through; (exit code, its last error line or '')."""
    proc = subprocess.Popen(args, stdout=None, stderr=subprocess.PIPE, text=True, errors="replace")
    error = ""
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            sys.stderr.write(line)
            if _is_error(line):
                error = line.strip()
        code = proc.wait()
    except KeyboardInterrupt:  # the point got the same SIGINT: wait for its checkpoint
        code = proc.wait()
        code = 130 if code == 0 else code
    return code, error


ERROR_LINE = re.compile(r"^(hpctrain: error\b|hpctrain: worker rank .* failed|[A-Za-z_.]*(Error|Exception): |"
                        r"error: )")
"""A line that says what went wrong: hpctrain's own error line, the launcher's failed-rank line, a Python exception.
Not the job script's own lines ('hpctrain: job step ended with exit code N', 'hpctrain: launching: ...')."""


def _is_error(line: str) -> bool:
    return bool(ERROR_LINE.match(line.strip()))


# ---- status ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PointStatus:
    name: str
    state: str
    """pending, running, done, failed, requeued (running again after a requeue), stopped, or unknown."""
    step: int | None
    metric: tuple[str, float] | None
    """The latest validation value of the experiment's main metric."""
    detail: str = ""


def status_command(sweep_dir: str) -> int:
    plan = read_plan(Path(sweep_dir))
    print(status_text(plan, collect_status(plan)))
    return 0


def collect_status(plan: SweepPlan) -> list[PointStatus]:
    from hpctrain.experiments import resolve_experiment

    main = resolve_experiment(plan.experiment).main_metric
    slurm_states = _array_states(plan)
    out = []
    for p in plan.points:
        records = _records(plan.run_dir(p))
        train = [r for r in records if r["split"] == "train"]
        val = [r for r in records if r["split"] == "val" and main in metric_values(r)]
        state, detail = slurm_states.get(p.index) or _local_state(plan, p.name)
        out.append(PointStatus(p.name, state, train[-1]["step"] if train else None,
                               (main, metric_values(val[-1])[main]) if val else None, detail))
    return out


def status_text(plan: SweepPlan, points: list[PointStatus]) -> str:
    lines = [f"sweep {plan.sweep_dir}: {plan.experiment}, {len(points)} point(s)",
             "| point | state | step | latest validation | |", "|---|---|---:|---|---|"]
    for s in points:
        metric = f"{s.metric[0]} {s.metric[1]:.4g}" if s.metric else "-"
        lines.append(f"| {s.name} | {s.state} | {'-' if s.step is None else s.step} | {metric} | {s.detail} |")
    counts: dict[str, int] = {}
    for s in points:
        counts[s.state] = counts.get(s.state, 0) + 1
    return "\n".join(lines + [", ".join(f"{n} {k}" for k, n in counts.items())])


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def _local_state(plan: SweepPlan, name: str) -> tuple[str, str]:
    path = plan.sweep_dir / STATUS_DIR / f"{name}.json"
    if path.exists():
        record = json.loads(path.read_text())
        return record["state"], record.get("error", "")
    return ("not run", "") if not (plan.sweep_dir / name).exists() else ("stopped", "")


SLURM_STATES = {"PENDING": "pending", "CONFIGURING": "running", "RUNNING": "running", "COMPLETING": "running",
                "COMPLETED": "done", "FAILED": "failed", "CANCELLED": "failed", "TIMEOUT": "failed",
                "OUT_OF_MEMORY": "failed", "NODE_FAIL": "failed", "PREEMPTED": "requeued", "REQUEUED": "requeued",
                "REQUEUE_HOLD": "requeued", "REQUEUE_FED": "requeued"}


def _array_states(plan: SweepPlan) -> dict[int, tuple[str, str]]:
    """Array index -> (state, detail) from Slurm for the sweep's last array job; {} for a local sweep. One scontrol
    call for every task Slurm still knows (pending ranges, requeue counts, exit codes), one sacct call for those it
    has forgotten (where accounting is set up), then the task logs; the logs alone where this machine has no Slurm
    commands."""
    jobs = job.recorded_jobs(plan.sweep_dir)
    if not jobs:
        return {}
    array_id = jobs[-1]
    states: dict[int, tuple[str, str]] = {}
    try:
        proc = job.run_slurm(["scontrol", "show", "job", "--oneliner", array_id])
        for line in (proc.stdout.splitlines() if proc.returncode == 0 else []):
            fields = job.parse_scontrol_fields(line)
            for index in _indices(fields.get("ArrayTaskId", "")):
                states[index] = _slurm_state(fields.get("JobState", ""), fields.get("Restarts", "0"),
                                             fields.get("ExitCode", "0:0"), fields.get("Reason", ""))
        missing = [p.index for p in plan.points if p.index not in states]
        if missing:
            proc = job.run_slurm(["sacct", "--noheader", "--parsable2", "-X", "--format=JobID,State,ExitCode",
                                  "-j", array_id])
            for line in (proc.stdout.splitlines() if proc.returncode == 0 else []):
                task, _, rest = line.partition("|")
                state, _, exit_code = rest.partition("|")
                for index in _indices(task.split("_", 1)[1]) if "_" in task else []:
                    states.setdefault(index, _slurm_state(state.split()[0] if state else "", "0", exit_code, ""))
    except UserError:  # no Slurm commands here (a copy of the sweep dir): the task logs
        pass
    for p in plan.points:
        if p.index not in states:
            states[p.index] = _state_from_log(plan, array_id, p.index)
    return states


def _slurm_state(state: str, restarts: str, exit_code: str, reason: str) -> tuple[str, str]:
    name = SLURM_STATES.get(state, state.lower() or "unknown")
    requeues = int(restarts or 0) if (restarts or "0").isdigit() else 0
    if requeues and name in ("pending", "running"):
        name = "requeued"
    detail = [f"requeued {requeues} time(s)" if requeues else "",
              f"exit code {exit_code}" if name == "failed" else "",
              reason if name in ("pending", "requeued") and reason not in ("", "None") else ""]
    return name, ", ".join(d for d in detail if d)


def _indices(tasks: str) -> list[int]:
    """Array indices of '3', '[2-5%2]', '0,4-6' ([] for anything else)."""
    tasks = tasks.strip("[]").split("%")[0]
    out: list[int] = []
    for part in tasks.split(","):
        lo, dash, hi = part.partition("-")
        if dash and lo.isdigit() and hi.isdigit():
            out += range(int(lo), int(hi) + 1)
        elif part.isdigit():
            out.append(int(part))
    return out


def _state_from_log(plan: SweepPlan, array_id: str, index: int) -> tuple[str, str]:
    logs = sorted((plan.sweep_dir / "logs").glob(f"*_{array_id}_{index}.out"))
    text = logs[-1].read_text(errors="replace") if logs else ""
    ended = re.findall(r"hpctrain: job step ended with exit code (\d+)", text)
    if not ended:
        return "unknown", "Slurm no longer knows the task and its log has no end"
    if ended[-1] == "0":
        return "done", ""
    errors = [line for line in text.splitlines() if _is_error(line)]
    return "failed", errors[-1].strip() if errors else f"exit code {ended[-1]}"


def point_error(plan: SweepPlan, name: str) -> str:
    """The error line of a failed point (local: its status file; Slurm: its task log)."""
    state, detail = _local_state(plan, name)
    if state == "failed":
        return detail
    index = next(p.index for p in plan.points if p.name == name)
    jobs = job.recorded_jobs(plan.sweep_dir)
    return _state_from_log(plan, jobs[-1], index)[1] if jobs else ""
