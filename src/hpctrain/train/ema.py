"""Exponential moving average of the weights, on torch's own AveragedModel (its state dict: module.*,
n_averaged), with an update that never waits for the GPU.

AveragedModel.update_parameters copies its step counter, a CPU tensor, to the device every step
(``n_averaged.to(device)``): a blocking host-to-device copy, which synchronises the GPU's stream once per step.
The EMA update needs the counter only to know whether this is the first update, and the CPU copy says that.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype


class EMA(AveragedModel):
    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay {decay} outside [0, 1]")
        # use_buffers: average batch-norm statistics too, so the EMA model is usable as it is.
        super().__init__(model, use_buffers=True)
        self.decay = decay

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """The same arithmetic as AveragedModel with get_ema_multi_avg_fn(decay): a copy on the first update,
        then lerp towards the model by 1 - decay (integer buffers: the same formula, truncated)."""
        # Under fsdp both modules are sharded the same way: each rank averages its own shards (local tensors).
        mine = [_local(t) for t in itertools.chain(self.module.parameters(), self.module.buffers())]
        theirs = [_local(t) for t in itertools.chain(model.parameters(), model.buffers())]
        if int(self.n_averaged) == 0:  # n_averaged lives on the CPU: reading it costs no device synchronisation
            for a, b in zip(mine, theirs, strict=True):
                a.copy_(b)
        else:
            grouped = _group_tensors_by_device_and_dtype([mine, theirs])
            for (_, dtype), ([ema, current], _) in grouped.items():
                if dtype.is_floating_point or dtype.is_complex:
                    torch._foreach_lerp_(ema, current, 1 - self.decay)
                else:
                    for a, b in zip(ema, current, strict=True):
                        a.copy_(a * self.decay + b * (1 - self.decay))
        self.n_averaged += 1


def _local(t: torch.Tensor) -> torch.Tensor:
    # No detach(): the updates run under no_grad, and a detach per tensor per step is a dispatch the host pays
    # (256 of the smoke U-Net's 1,203 operators per step, benchmarks/step_ops.py).
    return t.to_local() if isinstance(t, DTensor) else t


def build_ema(model: nn.Module, decay: float) -> EMA | None:
    return EMA(model, decay) if decay > 0 else None


def ema_step(ema, model: torch.nn.Module, skipped: torch.Tensor | bool) -> None:
    """The EMA's update after this step; a skipped step leaves its weights as they were (its count moves on)."""
    if skipped is False or int(ema.n_averaged) == 0:
        ema.update_parameters(model)  # the first update copies the model, which a skipped step left as it was
        return
    if skipped is not True:  # a device flag: the EMA keeps its values where it is 1, no host read
        ema_update(ema, model, 1 - ema.decay, skipped)
    ema.n_averaged += 1


@torch.no_grad()
def ema_update(ema, model: torch.nn.Module, weight: torch.Tensor | float, skipped: torch.Tensor | None = None) -> None:
    """EMA.update_parameters' lerp with the weight (1 - decay) in a device tensor, so a captured update reads it
    at every replay (a Python float would be frozen into the graph). ``skipped`` (a device flag, 1.0 for a skipped
    step): the EMA keeps its values, selected with torch.where, not weighted by 0: the skipped step's forward may have
    made the model's batch-norm statistics NaN, and 0 x NaN is NaN. The parameters need no select (one kernel per
    tensor on the host's path): a skipped step left the model's as they were, the ones the EMA already took in. The
    buffers go as a few flat tensors (:func:`_flat_update`), not one by one."""
    if skipped is not None:
        weight = weight * (1 - skipped)
    params = [(_local(a), _local(b)) for a, b in zip(ema.module.parameters(), model.parameters(), strict=True)]
    floats = [(a, b) for a, b in params if a.is_floating_point()]
    if floats:
        ema_t, cur_t = [a for a, _ in floats], [b for _, b in floats]
        delta = torch._foreach_sub(cur_t, ema_t)
        torch._foreach_mul_(delta, weight)
        torch._foreach_add_(ema_t, delta)
    rest = [(a, b) for a, b in params if not a.is_floating_point()]
    rest += [(_local(a), _local(b)) for a, b in zip(ema.module.buffers(), model.buffers(), strict=True)]
    _flat_update(rest, weight, None if skipped is None else skipped.bool())


def _flat_update(pairs: list[tuple[torch.Tensor, torch.Tensor]], weight, keep: torch.Tensor | None) -> None:
    """The EMA's buffers (and any integer parameters) updated per (device, dtype) group: the EMA's and the model's
    joined into one flat tensor each (torch.cat; torch.stack for 0-d ones such as batch norm's num_batches_tracked),
    the update and the skip's select on those, the result copied back through views (one _foreach_copy_): a handful of
    operations however many buffers, not five per buffer, which an eager step pays on the host and a captured one in
    kernels at every replay (a BatchNorm model has three buffers per layer). The values are those of the update
    tensor by tensor, bit for bit (the same elementwise operations). No host read and no data-dependent shape: it is
    captured in a CUDA graph as it is."""
    groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for a, b in pairs:
        if a.dim() > 1 and not a.is_contiguous():  # no flat view to write through (never seen): on its own
            new = _buffer_update(a, b, weight)
            a.copy_(new if keep is None else torch.where(keep, a, new))
            continue
        groups.setdefault((a.device, a.dtype, a.dim() == 0), []).append((a, b))
    for (_, _, scalars), group in groups.items():
        if scalars:  # stacked: one operation, however many (a view each would be one per buffer)
            mine = [a for a, _ in group]
            mine_flat, theirs_flat = torch.stack(mine), torch.stack([b for _, b in group])
        else:  # a 1-D tensor as it is (no operation), others as a flat view, which writes reach the buffer through
            mine = [a if a.dim() == 1 else a.view(-1) for a, _ in group]
            theirs = [b if b.dim() == 1 else b.reshape(-1) for _, b in group]
            mine_flat = mine[0] if len(mine) == 1 else torch.cat(mine)
            theirs_flat = theirs[0] if len(theirs) == 1 else torch.cat(theirs)
        new = _buffer_update(mine_flat, theirs_flat, weight)
        if keep is not None:
            new = torch.where(keep, mine_flat, new)
        new = new.to(mine_flat.dtype)  # as copy_ converts (an integer buffer truncates)
        if scalars:
            torch._foreach_copy_(mine, new.unbind())
        elif len(mine) == 1:
            mine[0].copy_(new)
        else:
            torch._foreach_copy_(mine, new.split([t.numel() for t in mine]))


def _buffer_update(a: torch.Tensor, b: torch.Tensor, weight) -> torch.Tensor:
    if a.is_floating_point():
        return a + (b - a) * weight
    return a * (1 - weight) + b * weight  # eager's formula, truncated by the copy into the integer buffer
