"""Moving batches to the device."""

from __future__ import annotations

from typing import Any

import torch


def to_device(batch: Any, device: torch.device, channels_last: bool = False) -> Any:
    """Tensors in (nested) tuples, lists and dicts; non_blocking pairs with pinned host memory so the copy
    overlaps compute."""
    if device.type == "cpu" and not channels_last:
        return batch  # loaders produce host memory: nothing to move, and a dispatch per tensor saved
    return _move(batch, device, channels_last)


def _move(batch: Any, device: torch.device, channels_last: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        batch = batch.to(device, non_blocking=True)
        if channels_last and batch.ndim == 4 and batch.is_floating_point():
            batch = batch.contiguous(memory_format=torch.channels_last)
        return batch
    if isinstance(batch, dict):
        return {k: _move(v, device, channels_last) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [_move(v, device, channels_last) for v in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    return batch
