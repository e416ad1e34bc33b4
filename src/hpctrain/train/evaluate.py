"""Exact distributed validation: sums per rank, one all-reduce, metrics from the totals."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable

import torch
from torch import nn

from hpctrain.dist.collectives import all_reduce_tensors, gather_objects
from hpctrain.dist.runtime import Runtime
from hpctrain.dist.wrap import reshard
from hpctrain.errors import UserError
from hpctrain.experiments.base import BatchInfo, Experiment, call_eval_stats
from hpctrain.train.device import to_device
from hpctrain.train.precision import Precision


@torch.no_grad()
def evaluate(
    experiment: Experiment,
    model: nn.Module,
    loader: Iterable | None,
    runtime: Runtime,
    precision: Precision,
    channels_last: bool = False,
    on_batch: Callable[[], None] | None = None,
    *,
    seed: int = 0,
    step: int = 0,
) -> dict[str, float]:
    """Collective. ``model`` is the plain module (not DDP): ranks may hold different numbers of batches, except
    under fsdp, where every forward is a collective and the sampler pads (a batch starting at -1 is run and its
    statistics dropped).
    ``on_batch`` is called before each batch: the loop's heartbeat, so a long validation is progress, not a hang.
    Each batch's BatchInfo carries the validation-set position of its first sample (from the loader's batch
    sampler), so per-sample draws do not depend on the world size."""
    modes = [(m, m.training) for m in model.modules()]  # each one's: a frozen teacher stays in eval afterwards
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    size = len(getattr(loader, "dataset", ()) or ()) if loader is not None else 0
    for batch, start in zip(loader or (), _batch_starts(loader)):
        if on_batch is not None:
            on_batch()
        batch = to_device(batch, runtime.device, channels_last)
        info = BatchInfo("val", step, max(start, 0), size, seed)
        with precision.autocast():
            stats = call_eval_stats(experiment, model, batch, info)
        if start < 0:  # a padding batch (fsdp): its forward was for the other ranks' collectives, its numbers are not
            continue
        for key, value in stats.items():
            value = torch.as_tensor(value).detach().double()  # a count may come as a plain int
            if key in totals and totals[key].shape != value.shape:
                raise _shape_error(key, tuple(value.shape), tuple(totals[key].shape), runtime.rank)
            totals[key] = totals[key] + value if key in totals else value
    for module, training in modes:
        module.training = training
    reshard(model)  # fsdp_reshard_after_forward=false: no backward follows to reshard the gathered parameters
    sums = all_reduce_tensors(_with_zeros_for_missing(totals, runtime), runtime)
    return experiment.metrics({k: float(v) if v.ndim == 0 else v for k, v in sums.items()})


def _batch_starts(loader: Any) -> Iterable[int]:
    """The first sample index of each batch the loader yields (validation batches are runs of consecutive
    indices; see EvalBatchSampler). Unknown sampler: positions counted from 0 on each rank (not invariant)."""
    sampler = getattr(loader, "batch_sampler", None)
    starts = getattr(sampler, "starts", None)
    if starts is not None:
        return starts()
    return itertools.count()


def _with_zeros_for_missing(totals: dict[str, torch.Tensor], runtime: Runtime) -> dict[str, torch.Tensor]:
    """A rank can have no validation batch (more ranks than batches); it still joins the all-reduce, with zeros
    of the right shape for the statistics the others report."""
    shapes: dict[str, tuple[int, ...]] = {}
    for rank, theirs in enumerate(gather_objects({k: tuple(v.shape) for k, v in totals.items()}, runtime)):
        for name, shape in theirs.items():
            if shapes.setdefault(name, shape) != shape:
                raise _shape_error(name, shape, shapes[name], rank)
    return {n: totals.get(n, torch.zeros(shape, dtype=torch.float64)) for n, shape in shapes.items()}


def _shape_error(name: str, shape: tuple[int, ...], other: tuple[int, ...], rank: int) -> UserError:
    return UserError(
        f"eval statistic '{name}' has shape {list(shape)} on rank {rank} and {list(other)} elsewhere",
        "eval_stats must return the same shape for a statistic on every batch and rank (e.g. a confusion matrix "
        "of num_classes x num_classes, not of the classes present in the batch).",
    )
