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
