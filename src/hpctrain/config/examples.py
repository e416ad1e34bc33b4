"""An example value for each list key, shown by `config --describe` and by the error a wrong value gets: each key's
own kind of item (module names for slurm.modules, NAME=value for slurm.env), not one example for every list."""

from __future__ import annotations

import json
import typing
from typing import Any

LIST_EXAMPLES: dict[str, list[Any]] = {
    "optim.betas": [0.9, 0.95],
    "alert.events": ["failure", "complete"],
    "log.trackers": ["wandb", "mlflow"],
    "log.tracker_tags": ["baseline", "ablation"],
    "slurm.extra_sbatch": ["--mail-type=END", "--reservation=big"],
    "slurm.modules": ["CUDA/12.4", "NCCL"],
    "slurm.setup": ["source ~/venvs/torch/bin/activate"],
    "slurm.container_binds": ["/scratch/data", "/datasets/cifar10:/data"],
    "slurm.env": ["NCCL_IB_TIMEOUT=22", "OMP_NUM_THREADS=8"],
    "slurm.preflight_args": ["--min-busbw", "20"],
    "fault.requeue_exit_codes": [76],
}
"""Keys of hpctrain's own sections. An experiment's [model] list keys get one from their item type."""

_BY_ITEM: dict[Any, tuple[Any, Any]] = {str: ("a", "b"), int: (1, 2), float: (0.5, 2.0), bool: (True, False)}


def list_example(key: str, typ: Any) -> str:
    """'a list such as [...]' for a key of type tuple[X, ...] or tuple[X, Y], written as TOML writes it."""
    args = typing.get_args(typ)
    fixed = not (len(args) == 2 and args[1] is Ellipsis)
    items = args if fixed else args[:1] * 2
    example = LIST_EXAMPLES.get(key) or [_BY_ITEM.get(a, ("a", "b"))[i % 2] for i, a in enumerate(items)]
    return f"a list {f'of {len(args)} values ' if fixed else ''}such as {json.dumps(example)}"
