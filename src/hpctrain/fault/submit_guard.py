"""Before sbatch: a run dir gets no second writer (a job of its own still queued or running, or a live training that
holds its run lock, fault/run_lock.py).

It asks both Slurm and the lock, so it sits above both: slurm/ imports nothing of fault/ (run_lock asks Slurm whether
a holder's job still lives, so the other direction would close a circle).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.fault import run_lock
from hpctrain.slurm import job


def refuse_busy_run_dir(run_dir: Path, force: bool = False) -> None:
    """Before sbatch: a run dir whose own job is still queued or running, or that a live training holds (a local
    one, or another cluster's job: fault/run_lock.py), gets no second writer. When Slurm does not answer whether
    the run dir's last job still runs, refused unless ``force`` (then said, and submitted)."""
    try:
        live = job.live_recorded_job(run_dir)
    except job.SlurmUnanswered as err:
        if not force:
            raise UserError(f"not submitted: could not ask Slurm whether a job of run dir {run_dir} still runs: "
                            f"{err.args[0]}", "try again in a minute (the controller may be busy); or, if you know "
                            "no job of this run dir is queued or running, submit with --force.") from None
        print(f"hpctrain: warning: Slurm did not say whether a job of {run_dir} still runs ({err.args[0]}); "
              "submitting anyway (--force)", file=sys.stderr)
        live = None
    if live is not None:
        job_id, state = live
        raise UserError(f"not submitted: run dir {run_dir} already has job {job_id} ({state}); two jobs would train "
                        "it at once", f"wait for it ({shlex.join(['hpctrain', 'slurm', 'status', str(run_dir)])}), "
                        f"or cancel it first ({shlex.join(['hpctrain', 'slurm', 'cancel', job_id])}), or choose "
                        "another run.dir.")
    refuse_held_run_dirs([run_dir])


def refuse_held_run_dirs(run_dirs: list[Path]) -> None:
    """Refused when a live training holds any of these run dirs (a sweep's points: one run dir each)."""
    held = [f"{run_dir} ({who})" for run_dir in run_dirs if (who := run_lock.holder(run_dir)) is not None]
    if held:
        raise UserError(f"not submitted: in use by a running training: {'; '.join(held)}",
                        "wait for it to end or stop it, or choose another run.dir (sweep dir).")
