"""Losses given as (sum, count): exact for any split of the global batch.

A loss over a varying number of items per sample (tokens of a sequence, frames of an utterance) averaged per
micro-batch, then over micro-batches and ranks, weighs a micro-batch with few tokens as much as one with many: its
gradient changes with train.micro_batch_size and the world size (the gradient-accumulation bug HF transformers
fixed in 2024 with num_items_in_batch). Given as (sum, count), each micro-batch's backward runs on its sum; once the
step's backward passes are done, one all-reduce of [sum, count] over the ranks gives the global count N, and the
gradients, which DDP and FSDP average over the W ranks, are multiplied by W / N: the gradient of the global sum over
the global count, whatever the split. No pre-pass over the data counts the tokens first.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

import torch
import torch.distributed as dist

from hpctrain.dist.runtime import Runtime
from hpctrain.errors import UserError, on_every_rank


class TokenLoss(NamedTuple):
    """One micro-batch's (sum, count), detached, as fp32 tensors on the device."""

    sum: torch.Tensor
    count: torch.Tensor


def as_token_loss(value: Any, where: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(sum, count)`` as (the sum to run backward on, the count as an fp32 tensor on the sum's device), or None
    for a plain tensor (a mean). ``where``: who returned it, for the message."""
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], torch.Tensor):
        total, count = value
        if total.ndim != 0:
            raise on_every_rank(UserError(f"{where} returned a (sum, count) whose sum has shape "
                                          f"{list(total.shape)}", "the sum is one number: e.g. loss.sum() over the "
                                          "micro-batch's tokens."))
        # A number becomes a tensor by a fill on the device (torch.tensor(n, device=cuda) would wait for the stream).
        count = count.detach().to(total.device, torch.float32) if isinstance(count, torch.Tensor) else \
            torch.full((), float(count), dtype=torch.float32, device=total.device)
        return total, count
    raise on_every_rank(UserError(
        f"{where} returned {type(value).__name__}", "return the micro-batch's mean loss as a 0-d tensor, or a pair "
        "(sum, count) of a loss summed over a varying number of items (tokens, frames) and that number."))


def global_mean(parts: list[TokenLoss], runtime: Runtime) -> tuple[torch.Tensor, torch.Tensor]:
    """(the global sum over the global count, the global count) of this rank's micro-batches and every other
    rank's: one all-reduce of two numbers, on the training group, without a host synchronisation."""
    totals = torch.stack([torch.stack([p.sum for p in parts]).sum(), torch.stack([p.count for p in parts]).sum()])
    if runtime.distributed:
        dist.all_reduce(totals)
    total, count = totals.unbind()
    return total / count.clamp_min(1.0), count


def scale_gradients(params: Iterable[torch.Tensor], count: torch.Tensor, world_size: int) -> None:
    """Gradients averaged over the ranks (DDP's all-reduce, FSDP's reduce-scatter) times world_size / count: the
    gradient of the global sum over the global count. A step with no items (count 0) leaves them as they are
    (zeros)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    factor = world_size / count.clamp_min(1.0)
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP2's DTensor shards: each its own
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in local:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), group in groups.items():  # under fsdp_cpu_offload the shards' gradients are on the host
        torch._foreach_mul_(group, factor.to(device=device, dtype=dtype))
