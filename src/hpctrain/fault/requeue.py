"""Requeue the Slurm job after a preemption checkpoint."""

from __future__ import annotations

import logging
import shutil
import subprocess

log = logging.getLogger("hpctrain")


def requeue_slurm_job(job_id: str, timeout_s: float = 30.0) -> bool:
    """Run 'scontrol requeue JOB_ID'; True on success. Failures are logged with what to do, not raised:
    the checkpoint is already safe, and the job's exit code still says 'requeue me'."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        log.error(
            "cannot requeue Slurm job %s: 'scontrol' is not on PATH (inside a container?). The checkpoint is "
            "saved. HINT: bind Slurm's binaries into the container, or requeue from the job script when the "
            "exit code is fault.exit_code; or resubmit the same run dir, which resumes.", job_id,
        )
        return False
    try:
        done = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.error("'scontrol requeue %s' did not answer in %.0f s; the checkpoint is saved", job_id, timeout_s)
        return False
    if done.returncode != 0:
        log.error(
            "'scontrol requeue %s' failed (exit %d): %s. HINT: the job must be requeueable (sbatch --requeue, "
            "JobRequeue=1); the checkpoint is saved, resubmitting the same run dir resumes.",
            job_id, done.returncode, (done.stderr or done.stdout).strip(),
        )
        return False
    log.info("requeued Slurm job %s", job_id)
    return True
