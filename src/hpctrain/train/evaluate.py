"""Exact distributed validation: sums per rank, one all-reduce, metrics from the totals."""

from __future__ import annotations

import torch
from torch import nn
from typing import Callable, Iterable

from hpctrain.dist.collectives import all_reduce_sums, gather_objects
from hpctrain.dist.runtime import Runtime
from hpctrain.experiments.base import Experiment
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
) -> dict[str, float]:
    """Collective. ``model`` is the plain module (not DDP): ranks may hold different numbers of batches.
    ``on_batch`` is called before each batch: the loop's heartbeat, so a long validation is progress, not a hang."""
    was_training = model.training
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    for batch in loader or ():
        if on_batch is not None:
            on_batch()
        batch = to_device(batch, runtime.device, channels_last)
        with precision.autocast():
            stats = experiment.eval_stats(model, batch)
        for key, value in stats.items():
            totals[key] = totals.get(key, 0) + value.detach().double()
    model.train(was_training)
    # A rank can have no validation batch (more ranks than batches); it still joins the
    # all-reduce, with zeros for the names the others report.
    names = sorted(set().union(*gather_objects(sorted(totals), runtime)))
    sums = all_reduce_sums({n: totals.get(n, 0.0) for n in names}, runtime)
    return experiment.metrics(sums)
