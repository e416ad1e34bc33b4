"""What a resumed run takes from its checkpoint and what from this launch's config.

The rule: **the config wins for hyper-parameters, the checkpoint keeps the state.** Every optimizer and schedule
key (optim.lr, betas, weight_decay, momentum, warmup_steps, schedule, poly_power, min_lr_ratio, ema_decay) and the
run's length (train.max_steps, train.epochs) apply from the resumed step, the schedule recomputed for the new length
at that step; the optimizer's moments and step counts, the scheduler's step and the EMA weights are the checkpoint's
(its param_groups and LambdaLR's base rates, loaded as they are, overrode the config while config.toml said
otherwise). An EMA turned on at a resume starts from the restored weights; one turned off is not carried on
(checkpoint/manager.py logs both). The optimizer itself (optim.name) cannot change: its state belongs to it; a change
is refused before any process starts, naming the key, as a changed model or global batch is.

The resume's log names each setting that differs from the checkpoint's config.toml, except bookkeeping keys
(config/changes.BOOKKEEPING). A config.toml that cannot be read (missing, not UTF-8, not TOML: a torn write) gives no
lines and no check: these compare settings, they are never a reason to stop a resume.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import torch

from hpctrain.config.changes import saved_config, setting_changes
from hpctrain.config.schema import RunConfig
from hpctrain.errors import UserError

FIXED = ("optim.name",)
"""Keys a resume cannot change: what the checkpoint's tensors are the state of."""

def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings as this launch built them (everything but its parameters): taken before a
    restore, put back after it by apply_hyperparameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def apply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler: Any, built: list[dict[str, Any]]) -> None:
    """After a restore: this launch's hyper-parameters (``built``, from hyperparameters() before the restore) and
    its schedule's rate at the restored step, over the checkpoint's. The scheduler's step (last_epoch) and the
    optimizer's state stay as loaded. The rate is computed as LambdaLR computes it (base x factor(step)), so an
    unchanged config resumes with exactly the saved rate."""
    if len(built) != len(optimizer.param_groups):
        raise ValueError(f"{len(built)} parameter groups built, {len(optimizer.param_groups)} restored")
    for group, fresh in zip(optimizer.param_groups, built):
        group.update(fresh)
    # ZeroRedundancyOptimizer's outer groups are these; it copies them into its inner optimizer at every step.
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    rates = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = list(rates)  # what get_last_lr() says until its next step


def refuse_fixed_changes(checkpoint: Path, cfg: RunConfig) -> None:
    """UserError when a key in FIXED differs from the checkpoint's config.toml (nothing is changed: the preflight
    calls this before any process starts). A checkpoint without a readable config.toml is not checked here; its
    load fails with the names it misses."""
    try:
        saved = tomllib.loads(saved_config(checkpoint) or "")
    except tomllib.TOMLDecodeError:
        return
    for key in FIXED:
        section, name = key.split(".")
        then, now = saved.get(section, {}).get(name), getattr(getattr(cfg, section), name)
        if then is not None and then != now:
            raise UserError(
                f"{key} changed: checkpoint '{checkpoint}' was saved with {key}={then}, this launch has {now}. The "
                f"checkpoint's optimizer state (moments, momentum buffers) belongs to {then}; nothing was changed",
                f"resume with {key}={then} (its hyper-parameters, e.g. optim.lr, may change: they apply from the "
                "resumed step), or start a new run (another run.dir).")


def changed_lines(saved_text: str, config_text: str, step: int) -> list[str]:
    """One line per setting that differs from the checkpoint's config.toml, for the resume's log:
    'optim.lr: 0.002 -> 0.1 from step 10'."""
    return [f"{key}: {_show(then)} -> {_show(now)} from step {step}"
            for key, then, now in setting_changes(saved_text, config_text)]


def changed_since(checkpoint: Path, config_text: str, step: int) -> list[str]:
    """changed_lines against the checkpoint's config.toml; none when it cannot be read."""
    saved = saved_config(checkpoint)
    return [] if saved is None else changed_lines(saved, config_text, step)


def _show(value: Any) -> str:
    return "(unset)" if value is None else repr(value) if isinstance(value, str) else str(value)
