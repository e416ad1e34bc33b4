"""Small collective helpers that are no-ops for one process, so callers need no branches."""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.dist.runtime import Runtime


def barrier(runtime: Runtime) -> None:
    if runtime.distributed:
        dist.barrier()


def all_reduce_sums(stats: Mapping[str, torch.Tensor | float], runtime: Runtime) -> dict[str, float]:
    """Sum named scalar statistics over all ranks in one collective, in float64.

    One packed tensor rather than a call per name: a collective costs latency, not bytes.
    """
    names = sorted(stats)
    packed = torch.stack(
        [torch.as_tensor(stats[n], dtype=torch.float64, device=runtime.device).reshape(()) for n in names]
    )
    if runtime.distributed:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return dict(zip(names, packed.tolist()))


def broadcast_object(obj: Any, runtime: Runtime, src: int = 0) -> Any:
    if not runtime.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=runtime.device if runtime.backend == "nccl" else None)
    return box[0]


def gather_objects(obj: Any, runtime: Runtime) -> list[Any]:
    """Every rank's object, on every rank."""
    if not runtime.distributed:
        return [obj]
    out: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_buffers(module: nn.Module, runtime: Runtime) -> None:
    """Every rank takes rank 0's buffers (batch-norm statistics), one broadcast per device and dtype.

    Under DDP the parameters agree on every rank, but each rank's buffers hold the statistics of its own last
    batches (DDP sends rank 0's only at the start of the next forward), and an EMA of them differs the same way.
    Rank 0's are the ones a checkpoint holds."""
    if not runtime.distributed:
        return
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for buffer in module.buffers():
        # NCCL moves only CUDA tensors: a buffer a user's model keeps on the CPU stays each rank's own.
        if runtime.backend != "nccl" or buffer.device.type == "cuda":
            groups.setdefault((buffer.device, buffer.dtype), []).append(buffer)
    for buffers in groups.values():
        packed = torch.cat([b.detach().reshape(-1) for b in buffers])
        dist.broadcast(packed, src=0)
        for b, part in zip(buffers, packed.split([b.numel() for b in buffers])):
            b.detach().copy_(part.view_as(b))
