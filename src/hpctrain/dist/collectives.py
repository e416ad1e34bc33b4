"""Small collective helpers that are no-ops for one process, so callers need no branches.

Two planes. The data plane is the default group (NCCL on GPUs) with dist.timeout_s: what each step does
(gradients, loss and metric sums), device tensors, a tight timeout. The control plane is runtime.control, a gloo
group with dist.control_timeout_s: barriers and Python objects, waits that may include rank 0's file system
(a checkpoint write, the end-of-run plots), never a device synchronisation."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hpctrain.dist.runtime import Runtime


def barrier(runtime: Runtime) -> None:
    """Control plane: every rank waits here, possibly for rank 0's file system."""
    if runtime.distributed:
        dist.barrier(group=runtime.control)


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
    # Pickled on the CPU and sent over gloo: on NCCL it would be copied to the GPU and back, synchronising it.
    dist.broadcast_object_list(box, src=src, group=runtime.control)
    return box[0]


def gather_objects(obj: Any, runtime: Runtime) -> list[Any]:
    """Every rank's object, on every rank (control plane). Costs world_size objects on every rank: where only
    rank 0 needs them, gather_to_main."""
    if not runtime.distributed:
        return [obj]
    out: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(out, obj, group=runtime.control)
    return out


def gather_to_main(obj: Any, runtime: Runtime) -> list[Any] | None:
    """Every rank's object, on rank 0 (in rank order); None on the other ranks (control plane)."""
    if not runtime.distributed:
        return [obj]
    out: list[Any] | None = [None] * runtime.world_size if runtime.is_main else None
    dist.gather_object(obj, out, dst=0, group=runtime.control)
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
