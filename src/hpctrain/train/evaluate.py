"""Exact distributed validation: sums per rank, one all-reduce, metrics from the totals."""

from __future__ import annotations

import torch

from hpctrain.dist.collectives import all_reduce_sums, gather_objects
from hpctrain.train.context import TrainContext
from hpctrain.train.device import to_device


@torch.no_grad()
def evaluate(ctx: TrainContext) -> dict[str, float]:
    # The EMA weights are the ones a run with EMA ships, so they are the ones validated.
    model = ctx.ema.module if ctx.ema is not None else ctx.raw_model
    was_training = model.training
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    for batch in ctx.val_loader or ():
        batch = to_device(batch, ctx.runtime.device, ctx.cfg.train.channels_last)
        with ctx.precision.autocast():
            stats = ctx.experiment.eval_stats(model, batch)
        for key, value in stats.items():
            totals[key] = totals.get(key, 0) + value.detach().double()
    model.train(was_training)
    # A rank can have no validation batch (more ranks than batches); it still joins the
    # all-reduce, with zeros for the names the others report.
    names = sorted(set().union(*gather_objects(sorted(totals), ctx.runtime)))
    sums = all_reduce_sums({n: totals.get(n, 0.0) for n in names}, ctx.runtime)
    return ctx.experiment.metrics(sums)
