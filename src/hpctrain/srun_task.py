"""What each task of a ``slurm.launcher=srun`` job runs: ``python -m hpctrain.slurm.task ARGS`` (a path kept for
the job scripts that call it), this module.

It is ``python -m hpctrain ARGS`` (the task is a training process itself: rank, local rank and world size
from srun's SLURM_PROCID/SLURM_LOCALID/SLURM_STEP_NUM_TASKS), plus the one thing the torchrun launcher does
per node that no training process would: the node monitors (``top -b``, ``nvidia-smi dmon``) of the job
script's HPCTRAIN_MONITOR_DIR, here started by each node's first task (local rank 0) around its own run and
stopped when it ends. Where each task is confined to its bound GPU (``--gpu-bind=per_task:1`` with
ConstrainDevices), ``nvidia-smi dmon`` in that task sees only its GPU, so ``dmon_HOST.log`` then records
one GPU of the node. The rest of what ``hpctrain.launch`` does needs no stand-in: srun and slurmstepd deliver
signals to every task, Slurm's KillWait bounds the grace after SIGTERM, and a failure ends the step through
``srun --kill-on-bad-exit=1``. An entry point (it runs the CLI), so not in slurm/.
"""

from __future__ import annotations

import sys
from typing import Sequence

from hpctrain.cli import main as hpctrain_main
from hpctrain.dist.env import detect_launch
from hpctrain.errors import UserError
from hpctrain.monitor.sidecars import node_monitors


def first_task_on_node() -> bool:
    try:
        return detect_launch().local_rank == 0
    except UserError:  # a malformed launch environment: the hpctrain command itself reports it
        return False


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not first_task_on_node():
        return hpctrain_main(args)
    with node_monitors():  # only when the job script asked for them (HPCTRAIN_MONITOR_DIR)
        return hpctrain_main(args)


if __name__ == "__main__":
    from hpctrain.process_exit import run_and_exit

    run_and_exit(main)  # no interpreter finalization, where torch's threads can abort the process
