"""Exponential moving average of the weights, on torch's own AveragedModel."""

from __future__ import annotations

from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def build_ema(model: nn.Module, decay: float) -> AveragedModel | None:
    if decay <= 0:
        return None
    # use_buffers: average batch-norm statistics too, so the EMA model is usable as it is.
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
