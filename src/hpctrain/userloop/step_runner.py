"""`hpctrain train` of a StepExperiment: hpctrain's loop around the experiment's own step.

The experiment's models are built, given their initial weights, wrapped per dist.strategy (with an EMA copy for
ema_models) and registered by name, its optimizers built from the wrapped models and registered by the same names
(their schedules too), and its data go through hpctrain's exact order; then each optimizer step is the
experiment's train_step on the session's Step, and every boundary is hpctrain train's: the vote, the records,
checkpoints, validation (eval_stats over the models, the averaged ones where kept) and outputs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpctrain.config.schema import RunConfig
from hpctrain.dist.collectives import barrier
from hpctrain.dist.runtime import Runtime
from hpctrain.dist.wrap import unwrap_model
from hpctrain.experiments.step_experiment import StepExperiment
from hpctrain.fault.run_lock import hold_run_dir
from hpctrain.train.compile_cache import node_copy_removed
from hpctrain.train.optim import as_scheduler
from hpctrain.train.run import init_weights
from hpctrain.userloop.core import TrainingSession
from hpctrain.userloop.objects import SCHEDULER_TYPES, misuse

log = logging.getLogger("hpctrain")


def run_step_experiment(cfg: RunConfig, runtime: Runtime, experiment_cls: type[StepExperiment],
                        config_text: str) -> int:
    """Train ``cfg`` with the experiment's own step; returns the exit code (0, fault.exit_code, or 130)."""
    experiment = experiment_cls(cfg)
    with hold_run_dir(Path(cfg.run_dir), runtime) as lock, \
            node_copy_removed(Path(cfg.run_dir), runtime.device, runtime.local_rank, cfg.train.compiled):
        run = TrainingSession(cfg, runtime, config_text, experiment=experiment, lock=lock)
        with run.opened():
            _train(run, experiment)
        return run.exit_code


def _train(run: TrainingSession, experiment: StepExperiment) -> None:
    cfg, runtime = run.cfg, run.runtime
    data = experiment.build_datasets()
    barrier(runtime)  # every node's staged data (data.stage_dir) is there before the first collective of the models
    models = _models(experiment)
    init_weights(experiment, nn.ModuleDict(models), cfg, runtime)
    decay = cfg.optim.ema_decay
    unknown = sorted(set(experiment.ema_models) - set(models))
    if unknown:
        raise misuse(f"{type(experiment).__name__}.ema_models names {unknown}, which build_models does not return",
                     f"name some of {sorted(models)}.")
    if experiment.ema_models and not decay and runtime.is_main:
        log.warning("%s.ema_models is set but optim.ema_decay=0: no EMA is kept (set optim.ema_decay, e.g. 0.999)",
                    type(experiment).__name__)
    wrapped = {name: run.wrap(model, ema=decay if name in experiment.ema_models else 0.0,
                              blocks=experiment.fsdp_blocks(model)) for name, model in models.items()}
    run.register(**wrapped)
    for name, (optimizer, schedule) in _optimizers(experiment, {n: unwrap_model(w) for n, w in wrapped.items()},
                                                   run).items():
        run.register(**{name: optimizer})
        if schedule is not None:
            run.register(**{name: schedule})
    steps = run.steps(data.train, collate_fn=data.collate_fn, transform=data.train_transform, val=data.val)
    for name, model in wrapped.items():
        if run.objects.models[name].trainable:
            model.train()  # once, the models an optimizer steps (a frozen teacher stays as built); validation puts
            # each module's mode back
    for step in steps:
        experiment.train_step(step)


def _models(experiment: StepExperiment) -> dict[str, nn.Module]:
    models = dict(experiment.build_models())
    where = f"{type(experiment).__name__}.build_models"
    if not models:
        raise misuse(f"{where} returned no models", "return a dict of name -> torch.nn.Module.")
    for name, model in models.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise misuse(f"{where}: the model name {name!r} is not an identifier", "name models like g, d, student.")
        if not isinstance(model, nn.Module):
            raise misuse(f"{where}: '{name}' is a {type(model).__name__}, not a torch.nn.Module",
                         "return fresh modules on the CPU.")
    return models


def _optimizers(experiment: StepExperiment, models: dict[str, nn.Module],
                run: TrainingSession) -> dict[str, tuple[torch.optim.Optimizer, Any]]:
    """Each optimizer (as dist.strategy runs it) with its schedule (an LRScheduler, or None)."""
    where = f"{type(experiment).__name__}.build_optimizers"
    built = dict(experiment.build_optimizers(models))
    zero = cfg_zero(run)
    out: dict[str, tuple[torch.optim.Optimizer, Any]] = {}
    for name, value in built.items():
        optimizer, schedule = value if isinstance(value, tuple) else (value, None)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise misuse(f"{where}: '{name}' is a {type(optimizer).__name__}, not a torch.optim.Optimizer",
                         "return name -> optimizer, or name -> (optimizer, schedule).")
        if zero and isinstance(schedule, SCHEDULER_TYPES):
            raise misuse(f"{where}: '{name}' comes with a {type(schedule).__name__} under dist.strategy=zero1, which "
                         "runs the optimizer rebuilt per rank", "return its schedule as a function of the step (the "
                         "factor of the initial rate; hpctrain runs it as LambdaLR on the rebuilt optimizer).")
        optimizer = run.wrap(optimizer)
        out[name] = (optimizer, None if schedule is None else as_scheduler(schedule, optimizer, f"{where}: '{name}'"))
    return out


def cfg_zero(run: TrainingSession) -> bool:
    return run.cfg.dist.strategy == "zero1" and run.runtime.distributed
