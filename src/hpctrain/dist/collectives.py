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


def all_reduce_max(stats: Mapping[str, float], runtime: Runtime) -> dict[str, float]:
    """The largest value of each named number over all ranks, in one collective (float64)."""
    names = sorted(stats)
    packed = torch.tensor([float(stats[n]) for n in names], dtype=torch.float64, device=runtime.device)
    if runtime.distributed:
        dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    return dict(zip(names, packed.tolist()))


def value_range(value: float, runtime: Runtime) -> tuple[float, float]:
    """(the smallest, the largest) of one number over all ranks, in one collective: equal when every rank has it."""
    spread = all_reduce_max({"high": float(value), "low": -float(value)}, runtime)
    return -spread["low"], spread["high"]


def all_reduce_tensors(stats: Mapping[str, torch.Tensor], runtime: Runtime) -> dict[str, torch.Tensor]:
    """Sum named tensors of any shapes (a confusion matrix, a histogram) over all ranks in one collective, in
    float64; returned on the CPU with their shapes. Every rank must pass the same names and shapes."""
    names = sorted(stats)
    parts = [torch.as_tensor(stats[n], dtype=torch.float64).to(runtime.device) for n in names]
    packed = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.zeros(0, dtype=torch.float64)
    if runtime.distributed and parts:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    flat = packed.cpu()  # once, at the end of a validation: the one synchronisation it needs
    out, at = {}, 0
    for name, part in zip(names, parts):
        out[name] = flat[at : at + part.numel()].reshape(part.shape)
        at += part.numel()
    return out


def gather_tensor_to_main(part: torch.Tensor, runtime: Runtime) -> torch.Tensor | None:
    """Every rank's tensor concatenated along dim 0 in rank order, on rank 0 (on the CPU); None elsewhere. Parts
    may differ in length along dim 0, not in their other dims or dtype. Data plane (device tensors, NCCL on
    GPUs): for images or predictions, which may be large."""
    if not runtime.distributed:
        return part.detach().cpu()
    lengths = gather_objects(int(part.shape[0]), runtime)
    longest = max(lengths)
    padded = part.detach().to(runtime.device)
    if padded.shape[0] < longest:  # all_gather needs equal shapes
        padded = torch.cat([padded, padded.new_zeros((longest - padded.shape[0], *padded.shape[1:]))])
    # gather, not all_gather: only rank 0 holds world x longest (50,000 samples are 150 MB as uint8).
    slots = [torch.empty_like(padded) for _ in range(runtime.world_size)] if runtime.is_main else None
    dist.gather(padded.contiguous(), slots, dst=0)
    if slots is None:
        return None
    return torch.cat([slot[:n] for slot, n in zip(slots, lengths)]).cpu()


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


def gather_to_main(obj: Any, runtime: Runtime, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's object, on rank 0 (in rank order); None on the other ranks. On the control plane, or on
    ``group`` (a gloo group of all ranks: the background checkpoint writer's own)."""
    if not runtime.distributed:
        return [obj]
    out: list[Any] | None = [None] * runtime.world_size if runtime.is_main else None
    dist.gather_object(obj, out, dst=0, group=group or runtime.control)
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


def scatter_objects(objs: list[Any] | None, runtime: Runtime) -> Any:
    """Control plane: objs[r] from rank 0 on rank r (``objs``, one object per rank, is read on rank 0 only)."""
    if not runtime.distributed:
        assert objs is not None and len(objs) == 1
        return objs[0]
    out: list[Any] = [None]
    dist.scatter_object_list(out, objs if runtime.is_main else None, src=0, group=runtime.control)
    return out[0]


BROADCAST_CHUNK_BYTES = 64 << 20
"""Bytes per collective in broadcast_bytes: large enough for NCCL's and gloo's full bandwidth, small enough that
the device buffer is negligible and that each collective ends well within dist.timeout_s."""


def broadcast_bytes(data: bytes | bytearray | None, nbytes: int, runtime: Runtime,
                    chunk_bytes: int = BROADCAST_CHUNK_BYTES) -> bytes | bytearray:
    """Data plane: rank 0's ``nbytes`` bytes on every rank (``data`` is read on rank 0 only; every rank knows
    ``nbytes``, e.g. from a broadcast_object). As DDP broadcasts module state: a uint8 tensor on the data plane,
    a CUDA one under NCCL (NVLink/InfiniBand, pipelined by NCCL's ring/tree), a CPU one under gloo, in chunks.
    Called after rank 0's file read, so these waits contain no file system, only the transfer."""
    if not runtime.distributed or nbytes == 0:
        return data if data is not None else b""
    main = runtime.is_main
    if main and (data is None or len(data) != nbytes):
        raise ValueError(f"broadcast_bytes: rank 0 has {None if data is None else len(data)} bytes, not {nbytes}")
    cuda = runtime.backend == "nccl"
    size = min(chunk_bytes, nbytes)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
    wire = torch.empty(size, dtype=torch.uint8, device=runtime.device) if cuda else host
    # numpy views move the bytes between the Python buffers and the tensors (torch.frombuffer would warn
    # about rank 0's read-only bytes).
    source = np.frombuffer(data, dtype=np.uint8) if main else None
    out = None if main else bytearray(nbytes)
    target = None if main else np.frombuffer(out, dtype=np.uint8)
    for start in range(0, nbytes, chunk_bytes):
        n = min(chunk_bytes, nbytes - start)
        if main:
            host.numpy()[:n] = source[start:start + n]
            if cuda:
                wire[:n].copy_(host[:n])
        dist.broadcast(wire[:n], src=0)
        if not main:
            if cuda:
                host[:n].copy_(wire[:n])
            target[start:start + n] = host.numpy()[:n]
    return data if main else out


BROADCAST_BUCKET_BYTES = 256 << 20


def broadcast_state(state: dict[str, Any], runtime: Runtime) -> None:
    """Every rank takes rank 0's values of a nested state dict (tensors filled in place, other values replaced),
    e.g. a checkpoint part rank 0 alone read. Tensors go in buckets (torch's coalesced broadcast, which DDP uses
    for its initial weights); device tensors on the training group, CPU tensors (an optimizer's step counts) on
    the control plane when the training group is NCCL; the small rest as one object on the control plane."""
    if not runtime.distributed:
        return
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._traverse import set_element

    flat, mappings = flatten_state_dict(state)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    others = broadcast_object({k: v for k, v in flat.items() if k not in tensors}, runtime)
    for key, value in others.items():
        set_element(state, mappings[key], value)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors.values():
        by_device.setdefault(tensor.device, []).append(tensor)
    for device, group in by_device.items():
        pg = runtime.control if device.type == "cpu" and runtime.backend == "nccl" else dist.group.WORLD
        dist._broadcast_coalesced(pg, group, BROADCAST_BUCKET_BYTES, 0)
