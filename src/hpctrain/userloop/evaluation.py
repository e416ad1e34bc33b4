"""run.evaluate: exact validation over a map-style data set with the user's functions, on train/evaluate.py's
machinery (sums per rank, one all-reduce, metrics from the totals), recorded at the run's step."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable

from hpctrain.data.loader import build_loader
from hpctrain.data.sampler import EvalBatchSampler
from hpctrain.dist.collectives import broadcast_buffers
from hpctrain.experiments.base import sums_over_count
from hpctrain.train.evaluate import evaluate as evaluate_sums
from hpctrain.userloop.data import is_map_style
from hpctrain.userloop.objects import misuse

if TYPE_CHECKING:
    from hpctrain.userloop.core import TrainingSession


def evaluate_over(run: "TrainingSession", stats: Callable[..., dict[str, Any]], data: Any,
                  metrics: Callable[[dict[str, Any]], dict[str, float]] | None, batch_size: int,
                  collate_fn: Callable | None) -> dict[str, float]:
    """Collective: the metrics of ``stats`` summed over ``data`` (see TrainingSession.evaluate)."""
    if not is_map_style(data):
        raise misuse(f"run.evaluate over a {type(data).__name__}", "give a map-style data set (len and [i]): "
                     "hpctrain deals its batches out so that the sums are exact on any number of ranks.")
    loader = run.eval_loaders.get(id(data))
    if loader is None:
        size = batch_size or run.cfg.eval.micro_batch_size or 2 * run.cfg.train.micro_batch_size
        sampler = EvalBatchSampler(len(data), size, run.runtime.rank, run.runtime.world_size,
                                   pad=run.runtime.distributed)
        loader = run.eval_loaders[id(data)] = build_loader(data, sampler, run.cfg.data, run.runtime,
                                                             collate_fn=collate_fn)
    models = run.objects.container()
    broadcast_buffers(models, run.runtime)  # rank 0's batch-norm statistics on every rank, as in validation
    # Numbered as the train records: the steps done. Inside a step (where step.eval_due says so) that step counts.
    step = 0 if run.ctx is None else run.ctx.state.step + (run.current is not None)
    result = evaluate_sums(_Sums(stats, metrics), models, loader, run.runtime, run.precision,
                           run.cfg.train.channels_last_on, on_batch=lambda: run.fault.heartbeat.mark("eval"),
                           seed=run.cfg.run.seed, step=step)
    if run.ctx is not None:
        run.ctx.metrics.log({"step": step, "split": "val", "epoch": run.ctx.state.epoch, **result})
    return result


class _Sums:
    """run.evaluate's functions as the experiment train/evaluate.py validates with."""

    def __init__(self, stats: Callable[..., dict[str, Any]], metrics: Callable | None) -> None:
        self.stats = stats
        self.metrics_fn = metrics
        params = [p for p in inspect.signature(stats).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.takes_info = len(params) >= 2

    def eval_stats(self, model, batch, info):
        return self.stats(batch, info) if self.takes_info else self.stats(batch)

    def metrics(self, totals: dict[str, Any]) -> dict[str, float]:
        if self.metrics_fn is not None:
            return self.metrics_fn(totals)
        return sums_over_count(totals)
