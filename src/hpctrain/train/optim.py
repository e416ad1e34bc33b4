"""Optimizer and learning-rate schedule from the config."""

from __future__ import annotations

import inspect
import math
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from hpctrain.config.schema import OptimSection, RunConfig
from hpctrain.dist.runtime import Runtime
from hpctrain.errors import UserError, on_every_rank
from hpctrain.experiments.base import Experiment, owns_optimizer, owns_scheduler


def build_optimizer(model: nn.Module, cfg: OptimSection, fused: bool = False,
                    groups: Sequence[Mapping[str, Any]] | None = None, zero: bool = False) -> torch.optim.Optimizer:
    """``fused`` (GPUs): torch's fused kernels, one launch per group instead of a foreach chain; a captured step
    (train.step_mode=graphed) needs them (tensor learning rate, the skip on a non-finite gradient).
    ``groups``: the experiment's parameter groups (Experiment.param_groups), each ``{"params": [...],
    "lr_scale": float}`` (lr_scale default 1: a group learns at optim.lr x lr_scale, under the same schedule);
    None: one group of all parameters. ``zero`` (dist.strategy=zero1): torch's ZeroRedundancyOptimizer around
    the same optimizer and groups; each rank keeps the state of its partition of the parameters, steps it, and
    broadcasts its updated parameters."""
    groups = prepared_groups(model, cfg, groups)
    if cfg.name == "sgd":
        cls, kwargs = torch.optim.SGD, {"lr": cfg.lr, "momentum": cfg.momentum, "nesterov": cfg.momentum > 0,
                                        "fused": fused or None}
    else:
        cls, kwargs = torch.optim.AdamW, {"lr": cfg.lr, "betas": cfg.betas, "fused": fused or None}
    return zero_redundancy(cls, kwargs, groups) if zero else cls(groups, **kwargs)


def prepared_groups(model: nn.Module, cfg: OptimSection,
                    groups: Sequence[Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The parameter groups hpctrain gives an optimizer: the experiment's (or one), checked, each split into the
    parameters that decay and those that do not (biases, norm weights), with its learning rate set."""
    return _split_decay(check_groups(model, groups), cfg.weight_decay, cfg.lr)


def zero_redundancy(cls: type, kwargs: Mapping[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """torch's ZeroRedundancyOptimizer stepping ``cls(**kwargs)`` over ``groups``, each rank its partition."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    # ZeRO takes the first group at construction and the others through add_param_group (its documented way).
    groups = [g for g in groups if g["params"]]
    first, rest = groups[0], groups[1:]
    hyper = {k: v for k, v in first.items() if k in ("lr", "weight_decay")}  # what the optimizer class takes
    optimizer = ZeroRedundancyOptimizer(first["params"], optimizer_class=cls, **(dict(kwargs) | hyper))
    # hpctrain's own keys (lr_scale, name) on the group the scheduler and the logs read; ZeRO copies every key of
    # its groups into the inner optimizer's at each step.
    optimizer.param_groups[0].update({k: v for k, v in first.items() if k != "params"})
    for group in rest:
        optimizer.add_param_group(group)
    return optimizer


def rebuilt_for_zero(optimizer: torch.optim.Optimizer, owner: str) -> torch.optim.Optimizer:
    """A user's optimizer as dist.strategy=zero1 runs it: the same class, defaults and groups inside
    ZeroRedundancyOptimizer (each rank builds and steps its partition). The optimizer must be fresh (no state yet)
    and take its defaults back as keyword arguments, as torch's own and most others do. ``owner``: who built it,
    for the message."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    cls = type(optimizer)
    hint = ("build it fresh (before any step) from arguments its class takes back as keywords, or use "
            "dist.strategy=ddp or fsdp.")
    if optimizer.state:
        raise UserError(f"dist.strategy=zero1: the optimizer {cls.__name__} of {owner} already holds state", hint)
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in optimizer.defaults.items() if takes_any or k in params}
    groups = [dict(g) for g in optimizer.param_groups]
    try:
        return zero_redundancy(cls, kwargs, groups)
    except (TypeError, ValueError) as err:
        raise UserError(f"dist.strategy=zero1: the optimizer {cls.__name__} of {owner} cannot be rebuilt per rank "
                        f"inside ZeroRedundancyOptimizer ({type(err).__name__}: {err})", hint) from None


def check_groups(model: nn.Module, groups: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """The groups, checked to hold every trainable parameter of ``model`` exactly once."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if groups is None:
        return [{"params": trainable, "lr_scale": 1.0}]
    out, seen = [], set()
    for i, group in enumerate(groups):
        params = [p for p in group["params"] if p.requires_grad]
        unknown = set(group) - {"params", "lr_scale", "weight_decay", "name"}
        if unknown:
            raise UserError(f"parameter group {i} has unknown keys {sorted(unknown)}",
                            "a group takes params, lr_scale, weight_decay and name.")
        twice = [p for p in params if id(p) in seen]
        if twice:
            raise UserError(f"parameter group {i} repeats {len(twice)} parameter(s) of an earlier group",
                            "Experiment.param_groups must put every parameter in one group only.")
        seen.update(id(p) for p in params)
        out.append({**group, "params": params, "lr_scale": float(group.get("lr_scale", 1.0))})
    missing = [p for p in trainable if id(p) not in seen]
    if missing:
        raise UserError(f"Experiment.param_groups leaves {len(missing)} trainable parameter(s) "
                        f"({sum(p.numel() for p in missing):,} values) out of every group",
                        "put every trainable parameter in a group (or set requires_grad=False to freeze it).")
    return out


def _split_decay(groups: list[dict[str, Any]], weight_decay: float, lr: float) -> list[dict[str, Any]]:
    """Each group in two: no weight decay on biases and norm weights (1-D tensors), decaying them only hurts.
    lr is set per group, so the scheduler (LambdaLR) scales each group's own base rate."""
    out = []
    for group in groups:
        decay = group.get("weight_decay", weight_decay)
        extra = {k: v for k, v in group.items() if k not in ("params", "weight_decay")}
        for params, wd in (([p for p in group["params"] if p.ndim >= 2], decay),
                           ([p for p in group["params"] if p.ndim < 2], 0.0)):
            out.append({**extra, "params": params, "weight_decay": wd, "lr": lr * group["lr_scale"]})
    return out


def base_lr(optimizer: torch.optim.Optimizer) -> float:
    """optim.lr as scheduled now (a group's rate over its lr_scale): what the logs call lr."""
    group = optimizer.param_groups[0]
    return group["lr"] / group.get("lr_scale", 1.0)


def lr_factor(step: int, total_steps: int, cfg: OptimSection) -> float:
    """Multiplier of optim.lr for optimizer step ``step`` (0-based): linear warmup, then decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "cosine":
        shape = 0.5 * (1 + math.cos(math.pi * progress))
    elif cfg.schedule == "poly":
        shape = (1 - progress) ** cfg.poly_power
    else:
        shape = 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimSection, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))


def as_scheduler(schedule: Any, optimizer: torch.optim.Optimizer, owner: str) -> Any:
    """A user's schedule as a scheduler: an LRScheduler (anything with step, state_dict and load_state_dict) as it
    is, a function of the step as LambdaLR. ``owner``: who built it, for the message."""
    if all(callable(getattr(schedule, name, None)) for name in ("step", "state_dict", "load_state_dict")):
        return schedule
    if callable(schedule):
        return LambdaLR(optimizer, schedule)
    raise UserError(f"{owner} returned {type(schedule).__name__} as a learning-rate schedule",
                    "return a torch.optim.lr_scheduler.LRScheduler of the optimizer, or a function step -> factor of "
                    "the initial learning rate.")


def experiment_optimizer(experiment: Experiment, raw: torch.nn.Module, cfg: RunConfig,
                         runtime: Runtime) -> torch.optim.Optimizer:
    """hpctrain's optimizer from the config, or the experiment's own (build_optimizer) from the same prepared
    parameter groups; under zero1 either runs inside ZeroRedundancyOptimizer."""
    zero = cfg.dist.strategy == "zero1" and runtime.distributed
    groups = experiment.param_groups(raw)
    if not owns_optimizer(type(experiment)):
        return build_optimizer(raw, cfg.optim, fused=runtime.device.type == "cuda", groups=groups, zero=zero)
    owner = f"{type(experiment).__name__}.build_optimizer"
    optimizer = on_every_rank_if_user_error(lambda: experiment.build_optimizer(prepared_groups(raw, cfg.optim, groups)))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise on_every_rank(UserError(f"{owner} returned {type(optimizer).__name__}, not a torch.optim.Optimizer",
                                      "return an optimizer built from the groups it is given."))
    return on_every_rank_if_user_error(lambda: rebuilt_for_zero(optimizer, owner)) if zero else optimizer


def experiment_scheduler(experiment: Experiment, optimizer: torch.optim.Optimizer, cfg: RunConfig,
                         total_steps: int):
    """The config's schedule (LambdaLR of optim.schedule), or the experiment's own (build_scheduler)."""
    if not owns_scheduler(type(experiment)):
        return build_scheduler(optimizer, cfg.optim, total_steps)
    owner = f"{type(experiment).__name__}.build_scheduler"
    return on_every_rank_if_user_error(lambda: as_scheduler(experiment.build_scheduler(optimizer, total_steps),
                                                            optimizer, owner))


def on_every_rank_if_user_error(make):
    """``make()``; a UserError it raises is every rank's (they all build the same objects from the same config)."""
    try:
        return make()
    except UserError as err:
        raise on_every_rank(err) from None
