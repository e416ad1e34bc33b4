"""A sweep's status (`hpctrain sweep status`): every point's state, step and latest validation metric.

A point's state comes from the last array job that ran it (a sweep submitted again runs only its unfinished points
in a new array: the points an earlier array finished keep that array's state), else from its local status file
(`--local`); steps and metrics come from the run dirs."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from hpctrain.config.target import is_script
from hpctrain.errors import UserError
from hpctrain.metrics.records import read_metrics
from hpctrain.slurm import exits, job
from hpctrain.slurm.progress import latest_step
from hpctrain.sweep.grid import Point
from hpctrain.sweep.metric import MetricSource, curve_from_log, curve_from_records, metric_source
from hpctrain.sweep.spec import SweepSpec

STATUS_DIR = "status"
"""SWEEP_DIR/status/NAME.json: how a local run of a point ended (state, exit code, its error line)."""


@dataclass(frozen=True)
class PointStatus:
    name: str
    state: str
    """pending, running, done, failed, cancelled, not started, requeued (running again after a requeue), stopped,
    not run, or unknown. Every state but done is unfinished: the same submit command runs the point again."""
    step: int | None
    metric: tuple[str, float] | None
    """The latest validation value of the experiment's main metric (a script's: of the metric its sweep names)."""
    detail: str = ""


def collect_status(plan: SweepSpec) -> list[PointStatus]:
    source = metric_source(plan)
    slurm_states = _array_states(plan)
    out = []
    for p in plan.points:
        records = _records(plan.run_dir(p))
        curve = point_curve(plan, p, source, records)
        state, detail = slurm_states.get(p.index) or _local_state(plan, p.name)
        step = latest_step(records)
        if step is None and curve and source.line:  # a script that logs no records: its metric's last step
            step = curve[-1][0]
        out.append(PointStatus(p.name, state, step, (source.name, curve[-1][1]) if curve else None, detail))
    return out


def point_curve(plan: SweepSpec, point: Point, source: MetricSource,
                records: list[dict] | None = None) -> list[tuple[int, float]]:
    """(step, value) of the point's metric: from its metrics.jsonl, or from its logs (--metric-line: the logs of
    the array tasks that ran it, then its local run's)."""
    if source.line:
        logs = [log for array_id in job.recorded_jobs(plan.sweep_dir) for log in _task_logs(plan, array_id, point.index)]
        local = plan.sweep_dir / "logs" / f"local_{point.name}.out"
        text = "".join(p.read_text(errors="replace") for p in (*logs, *([local] if local.exists() else [])))
        return curve_from_log(text, source.line)
    return curve_from_records(_records(plan.run_dir(point)) if records is None else records, source)


def status_text(plan: SweepSpec, points: list[PointStatus]) -> str:
    latest = "latest validation" if not is_script(plan.experiment) else "latest metric"
    lines = [f"sweep {plan.sweep_dir}: {plan.experiment}, {len(points)} point(s)",
             f"| point | state | step | {latest} | |", "|---|---|---:|---|---|"]
    for s in points:
        metric = f"{s.metric[0]} {s.metric[1]:.4g}" if s.metric else "-"
        lines.append(f"| {s.name} | {s.state} | {'-' if s.step is None else s.step} | {metric} | {s.detail} |")
    counts: dict[str, int] = {}
    for s in points:
        counts[s.state] = counts.get(s.state, 0) + 1
    return "\n".join(lines + [", ".join(f"{n} {k}" for k, n in counts.items())])


def point_error(plan: SweepSpec, name: str) -> str:
    """The error line of a failed point (Slurm: the task log of the array that last ran it; local: its status
    file)."""
    index = next(p.index for p in plan.points if p.name == name)
    array_id = array_owners(plan).get(index)
    if array_id is not None:  # a script's point: the failing rank, host and error line its nodes recorded
        recorded = exits.failure_line(exits.latest_records(plan.sweep_dir / name, f"{array_id}_{index}"))
        return recorded or _state_from_log(plan, array_id, index)[1]
    state, detail = _local_state(plan, name)
    return detail if state == "failed" else ""


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def _local_state(plan: SweepSpec, name: str) -> tuple[str, str]:
    path = plan.sweep_dir / STATUS_DIR / f"{name}.json"
    if path.exists():
        record = json.loads(path.read_text())
        return record["state"], record.get("error", "")
    return ("not run", "") if not (plan.sweep_dir / name).exists() else ("stopped", "")


# ---- Slurm's view ------------------------------------------------------------------------------------------------

SLURM_STATES = {"PENDING": "pending", "CONFIGURING": "running", "RUNNING": "running", "COMPLETING": "running",
                "COMPLETED": "done", "FAILED": "failed", "CANCELLED": "cancelled", "TIMEOUT": "failed",
                "OUT_OF_MEMORY": "failed", "NODE_FAIL": "failed", "PREEMPTED": "requeued", "REQUEUED": "requeued",
                "REQUEUE_HOLD": "requeued", "REQUEUE_FED": "requeued"}

ARRAY_LINE = re.compile(r"^#SBATCH --array=(\S+)", re.MULTILINE)


def array_owners(plan: SweepSpec) -> dict[int, str]:
    """Array index -> the last recorded array job that ran it. Each array's points are read from its recorded
    script's `#SBATCH --array=` line (a sweep submitted again runs only its unfinished points); a script that is
    gone counts as every point."""
    owners: dict[int, str] = {}
    for array_id in job.recorded_jobs(plan.sweep_dir):
        script = plan.sweep_dir / "slurm" / f"job_{array_id}.sh"
        found = ARRAY_LINE.search(script.read_text()) if script.is_file() else None
        for index in _indices(found.group(1)) if found else [p.index for p in plan.points]:
            owners[index] = array_id
    return owners


def _array_states(plan: SweepSpec) -> dict[int, tuple[str, str]]:
    """Array index -> (state, detail) from the array that last ran each point; {} for a local sweep."""
    by_array: dict[str, list[int]] = {}
    for index, array_id in array_owners(plan).items():
        by_array.setdefault(array_id, []).append(index)
    states: dict[int, tuple[str, str]] = {}
    for array_id, indices in by_array.items():
        known = _one_array(plan, array_id, indices)
        states.update({i: known.get(i) or _state_from_log(plan, array_id, i) for i in indices})
    return states


def _one_array(plan: SweepSpec, array_id: str, indices: list[int]) -> dict[int, tuple[str, str]]:
    """One scontrol call for every task Slurm still knows (pending ranges, requeue counts, exit codes), one sacct
    call where it has forgotten some (where accounting is set up); {} where this machine has no Slurm commands (a
    copy of the sweep dir: the caller reads the task logs)."""
    states: dict[int, tuple[str, str]] = {}
    try:
        proc = job.run_slurm(["scontrol", "show", "job", "--oneliner", array_id])
        for line in (proc.stdout.splitlines() if proc.returncode == 0 else []):
            fields = job.parse_scontrol_fields(line)
            for index in _indices(fields.get("ArrayTaskId", "")):
                states[index] = _slurm_state(fields.get("JobState", ""), fields.get("Restarts", "0"),
                                             fields.get("ExitCode", "0:0"), fields.get("Reason", ""),
                                             _ran(plan, array_id, index, fields.get("RunTime", "")))
        if all(i in states for i in indices):
            return states
        proc = job.run_slurm(["sacct", "--noheader", "--parsable2", "-X", "--format=JobID,State,ExitCode,Elapsed",
                              "-j", array_id])
        for line in (proc.stdout.splitlines() if proc.returncode == 0 else []):
            task, state, exit_code, elapsed = (line.split("|") + ["", "", "", ""])[:4]
            for index in _indices(task.split("_", 1)[1]) if "_" in task else []:
                states.setdefault(index, _slurm_state(state.split()[0] if state else "", "0", exit_code, "",
                                                      _ran(plan, array_id, index, elapsed)))
    except UserError:
        pass
    return states


def _ran(plan: SweepSpec, array_id: str, index: int, run_time: str) -> bool:
    """Whether the task started: Slurm counted run time, or it wrote its log (a task cancelled while pending has
    neither)."""
    return bool(run_time.strip("0:-")) or bool(_task_logs(plan, array_id, index))


def _slurm_state(state: str, restarts: str, exit_code: str, reason: str, ran: bool = True) -> tuple[str, str]:
    name = SLURM_STATES.get(state, state.lower() or "unknown")
    requeues = int(restarts or 0) if (restarts or "0").isdigit() else 0
    if requeues and name in ("pending", "running"):
        name = "requeued"
    detail = [f"requeued {requeues} time(s)" if requeues else "",
              f"exit code {exit_code}" if name == "failed" else "",
              "not started" if name == "cancelled" and not ran else "",
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


def _task_logs(plan: SweepSpec, array_id: str, index: int) -> list[Path]:
    return sorted((plan.sweep_dir / "logs").glob(f"*_{array_id}_{index}.out"))


def _state_from_log(plan: SweepSpec, array_id: str, index: int) -> tuple[str, str]:
    logs = _task_logs(plan, array_id, index)
    if not logs:  # Slurm opens the log when the task starts
        return "not started", f"Slurm no longer knows task {array_id}_{index} and it wrote no log"
    text = logs[-1].read_text(errors="replace")
    ended = re.findall(r"hpctrain: job step ended with exit code (\d+)", text)
    if not ended:
        return "unknown", "Slurm no longer knows the task and its log has no end"
    if ended[-1] == "0":
        return "done", ""
    errors = [line for line in text.splitlines() if is_error(line)]
    return "failed", errors[-1].strip() if errors else f"exit code {ended[-1]}"


ERROR_LINE = re.compile(r"^(hpctrain: error\b|hpctrain: worker rank .* failed|[A-Za-z_.]*(Error|Exception): |"
                        r"error: )")
"""A line that says what went wrong: hpctrain's own error line, the launcher's failed-rank line, a Python exception.
Not the job script's own lines ('hpctrain: job step ended with exit code N', 'hpctrain: launching: ...')."""


def is_error(line: str) -> bool:
    return bool(ERROR_LINE.match(line.strip()))
