"""A sweep as one Slurm job array: the single-run job spec made an array over the points, which points a sweep
submitted again still has to run, and the refusal while its last array is queued or running."""

from __future__ import annotations

import dataclasses
import shlex

from hpctrain.errors import UserError
from hpctrain.slurm import job, render
from hpctrain.sweep.spec import SweepSpec
from hpctrain.sweep.status import collect_status


def unfinished(plan: SweepSpec) -> tuple[str, ...]:
    """Going on with a sweep submitted before: refused while its array is still queued or running (two trainings
    would write one run dir); else the indices of the points not done (("none",) when all are)."""
    refuse_live_array(plan)
    states = collect_status(plan)
    todo = tuple(str(p.index) for p, s in zip(plan.points, states) if s.state != "done")
    return todo or ("none",)


def refuse_live_array(plan: SweepSpec, force: bool = False) -> None:
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


def array_spec(plan: SweepSpec, configs: dict, max_parallel: int, indices: tuple[int, ...] = (),
               nproc_per_node: int = 0) -> render.JobSpec:
    """The single-run spec of the first point, made an array over all of them (they share the [slurm] section:
    a sweep cannot vary slurm.* keys), its logs and records in the sweep dir; a script's points each with their own
    arguments (their settings are copied from the sweep dir by the job)."""
    first = configs[plan.points[0].name]
    spec = job.job_spec(first, nproc_per_node=nproc_per_node)
    array = render.ArraySpec(sweep_dir=str(plan.sweep_dir), points=tuple(p.name for p in plan.points),
                             max_parallel=max_parallel, indices=indices)
    name = first.slurm.job_name or f"sweep-{plan.sweep_dir.name}"
    script = spec.script and dataclasses.replace(
        spec.script, point_args=tuple(plan.script_args_of(p) for p in plan.points))
    return dataclasses.replace(spec, job_name=name, run_dir=str(plan.sweep_dir), config_toml="", array=array,
                               script=script)
