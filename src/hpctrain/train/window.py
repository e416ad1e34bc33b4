"""The log window: what the train records average, from one record to the next, and how a checkpoint keeps the
open one (TrainState.log_loss, log_steps, log_values) so that a resumed run's records equal an uninterrupted one's.

An Experiment's window holds its one loss (a mean per rank and step); a multi-model step's or a user loop's holds
named values (step.log), each a mean or a (sum, count), reduced in the same one all-reduce at each record.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from hpctrain.dist.collectives import all_reduce_sums, value_range
from hpctrain.errors import UserError, agreed_on_every_rank

if TYPE_CHECKING:
    from hpctrain.train.context import TrainContext


def open_window(ctx: TrainContext, window: "Window") -> tuple[float, int]:
    """The open log window as a checkpoint holds it (TrainState.log_loss, log_steps; log_values and log_kinds for
    named values, set here): world-size independent, one small all-reduce when it has steps in this launch (the
    same count on every rank)."""
    kinds = window.carried_kinds | window.kinds
    if not window.steps and not window.named_steps:  # the same on every rank
        ctx.state.log_values, ctx.state.log_kinds = dict(window.carried_named), kinds
        return window.carried_loss, window.carried_steps
    stats = {"loss": window.loss_sum} | named_stats(ctx, window, carried=0.0)
    sums = all_reduce_sums(stats, ctx.runtime)
    world = ctx.runtime.world_size
    values = {}
    for name, kind in kinds.items():
        share = world if kind == "mean" else 1  # a mean's parts as log_loss keeps them: over the ranks' mean
        then = window.carried_named.get(name, [0.0, 0.0])
        values[name] = [then[0] + sums[f"{name}\0num"] / share, then[1] + sums[f"{name}\0den"] / share]
    ctx.state.log_values, ctx.state.log_kinds = values, kinds
    return window.carried_loss + sums["loss"] / world, window.carried_steps + window.steps


def named_stats(ctx: TrainContext, window: "Window", carried: float) -> dict[str, Any]:
    """The window's named values (step.log of a multi-model step or a user's loop) for one all-reduce: a
    numerator and a denominator each, with the carried window's on rank 0 (``carried``: this rank's weight of it,
    see log_train). Every rank must log the same names: checked first with one small all-reduce (a name logged on
    one rank only would otherwise mismatch the packed sums)."""
    kinds = window.carried_kinds | window.kinds
    _check_same_names(ctx, sorted(kinds))
    stats: dict[str, Any] = {}
    for name, kind in kinds.items():
        num, den = window.named.get(name, (0.0, 0.0))
        then = window.carried_named.get(name, [0.0, 0.0])
        weight = carried if kind == "mean" else float(carried > 0)
        stats[f"{name}\0num"] = num + weight * then[0]
        stats[f"{name}\0den"] = den + weight * then[1]
    return stats


def _check_same_names(ctx: TrainContext, names: list[str]) -> None:
    if not ctx.runtime.distributed or ctx.objects is None:  # an Experiment logs no names: no collective for it
        return
    import zlib

    low, high = value_range(zlib.crc32("\n".join(names).encode()), ctx.runtime)
    if low != high:
        raise agreed_on_every_rank(UserError(
            f"the ranks logged different values since the last train record (rank {ctx.runtime.rank}: "
            f"{', '.join(names) or 'none'})", "log the same names on every rank at every step (step.log): a rank "
            "without a value logs (0.0, 0) for a (sum, count)."))


def per_optimizer(key: str, values: dict[str, float]) -> dict[str, float]:
    """lr or grad_norm of each optimizer: the key itself for one, key_NAME for several."""
    if len(values) == 1:
        return {key: next(iter(values.values()))}
    return {f"{key}_{name}": value for name, value in values.items()}


class Window:
    """Loss and time since the last log line; stays on the device until log_train."""

    def __init__(self, step: int, busy=None) -> None:
        self.launch_step = step
        self.warned_loader_bound = self.warned_host_bound = False
        self.busy = busy
        """NvmlBusy for this rank's GPU (monitor/gpu_busy.py), or None."""
        if busy is not None:
            busy.mark()  # after this, each read() is the window since the previous one
        self.reset(step)

    def reset(self, step: int) -> None:
        self.first_step, self.started = step, time.perf_counter()
        self.loss_sum: torch.Tensor | float = 0.0
        self.steps = 0
        self.grad_norm: torch.Tensor | None = None
        self.lr = 0.0
        self.data_wait = 0.0
        self.carried_loss, self.carried_steps = 0.0, 0
        """The window's steps before a stop, from the checkpoint (TrainState.log_loss, log_steps): their summed
        loss (mean over the ranks) and their count."""
        self.named: dict[str, tuple[Any, Any]] = {}
        """Named values logged since the last record (step.log): name -> (numerator, denominator) of this rank, on the
        device until log_train: a mean's value and its count of steps, a (sum, count)'s sums."""
        self.kinds: dict[str, str] = {}
        """Each named value's kind: mean or ratio."""
        self.carried_named: dict[str, list[float]] = {}
        self.carried_kinds: dict[str, str] = {}
        """The same from the checkpoint (TrainState.log_values, log_kinds)."""
        self.named_steps = 0
        """Steps of a multi-model step or a user's loop in this window (those log named values, not a loss)."""
        self.grad_norms: dict[str, torch.Tensor] = {}
        """Each optimizer's last gradient norm (a multi-model step), by name."""
        self.lrs: dict[str, float] = {}
        """Each optimizer's learning rate this step (a multi-model step), by name."""
        self.disturbed = False
        """Something else than training steps ran in this window (validation, a checkpoint, outputs, the loader's
        start, the graph's warm-up and capture): its GPU time says nothing about the step."""

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        self.loss_sum = self.loss_sum + loss
        self.steps += 1
        self.grad_norm = grad_norm

    def add_named(self, name: str, kind: str, num: Any, den: Any) -> None:
        """A named value of one step: a mean (num the value, den 1) or a (sum, count) (kind ratio)."""
        known = self.kinds.get(name) or self.carried_kinds.get(name)
        if known is not None and known != kind:
            raise UserError(f"'{name}' was logged as a {known} and now as a {kind}",
                            "log a name always as a (sum, count) pair or always as a mean.")
        self.kinds[name] = kind
        then = self.named.get(name)
        self.named[name] = (num, den) if then is None else (then[0] + num, then[1] + den)
