"""A CPU copy of a checkpoint's state, taken in one pause, so training can go on while it is written.

torch.distributed.checkpoint's async_save does this for its own sharded format (a staging copy,
then a background write); hpctrain's format is plain torch.save files with a manifest (readable
without hpctrain, and by any world size), so the copy is written here. It copies each tensor
*storage* once and rebuilds the tensors as views of the copies, so shared storages and views stay
shared: torch.save then writes exactly the bytes it would have written for the live state.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch


class CpuStaging:
    """Takes snapshots into CPU buffers kept from the previous snapshot (as torch.distributed.checkpoint's
    staging does): the second and later saves copy into memory that is already mapped, instead of
    faulting in fresh pages for every byte. Reuse is safe only after the previous snapshot is written;
    the Checkpointer waits for that write before it takes the next snapshot.

    The copy of a CUDA storage goes into pinned (page-locked) memory, issued non_blocking, and the snapshot
    synchronises once after all of them: the device-to-host copies run at the link's speed and back to back,
    instead of one synchronous copy through a pageable bounce buffer per tensor. Pinned buffers come from
    torch's caching host allocator (as in torch.distributed.checkpoint's staging), which rounds each up to a
    power of two; they are kept across saves like the others."""

    def __init__(self) -> None:
        self._buffers: list[tuple[torch.UntypedStorage, bool]] = []  # (buffer, pinned)

    def snapshot(self, obj: Any, copy_cpu_tensors: bool = True) -> Any:
        """A deep copy of a state dict tree whose tensors live on the CPU, in memory of their own.

        copy.deepcopy keeps every other sharing intact (the same betas tuple in two optimizer param
        groups, the state dict's `_metadata`), which torch.save's pickle memo would otherwise write
        differently; the tensors are put into its memo beforehand as CPU copies. When this returns, every
        copy is complete: training may change the live tensors at once.

        copy_cpu_tensors=False (a synchronous save, written before training goes on) copies only the tensors
        on a device and keeps the CPU ones as they are: the tree is then all CPU tensors, and torch.save writes
        the same bytes as for a full snapshot, for no copy at all on a CPU-only run."""
        spare: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        for buffer, pinned in self._buffers:
            spare.setdefault((buffer.nbytes(), pinned), []).append(buffer)
        used: list[tuple[torch.UntypedStorage, bool]] = []
        storages: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
        memo: dict[int, Any] = {}
        streams: set[torch.device] = set()
        for t in _tensors(obj):
            if id(t) in memo:
                continue
            if t.device.type == "cpu" and not copy_cpu_tensors:
                memo[id(t)] = t
                continue
            memo[id(t)] = _copy_tensor(t, storages, spare, used)
            if t.device.type == "cuda":
                streams.add(t.device)
        for device in streams:  # the non_blocking copies were issued on each device's current stream
            torch.cuda.current_stream(device).synchronize()
        self._buffers = used
        return copy.deepcopy(obj, memo)


def cpu_snapshot(obj: Any) -> Any:
    """A one-off snapshot (fresh buffers)."""
    return CpuStaging().snapshot(obj)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _copy_tensor(t: torch.Tensor, storages: dict[tuple[torch.device, int], torch.UntypedStorage],
                 spare: dict[tuple[int, bool], list[torch.UntypedStorage]],
                 used: list[tuple[torch.UntypedStorage, bool]]) -> torch.Tensor:
    src = t.untyped_storage()
    key = (src.device, src.data_ptr())  # a CPU and a CUDA storage may have the same address
    pinned = src.device.type == "cuda"
    if src.nbytes() == 0:  # empty storages share data_ptr 0: never memoised
        stored = torch.UntypedStorage(0)
    elif key in storages:
        stored = storages[key]
    else:
        # The state has the same storages at every save: a buffer of the same size (and kind) that held a
        # storage's bytes last time is free now; anything else gets fresh memory.
        same = spare.get((src.nbytes(), pinned))
        stored = same.pop(0) if same else _new_buffer(src.nbytes(), pinned)
        # From CUDA into pinned memory: asynchronous, the caller synchronises once after all the copies.
        stored.copy_(src, non_blocking=pinned)
        storages[key] = stored
        used.append((stored, pinned))
    view = torch.empty(0, dtype=t.dtype)
    view.set_(stored, t.storage_offset(), t.size(), t.stride())
    return view


def _new_buffer(nbytes: int, pinned: bool) -> torch.UntypedStorage:
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
    return torch.UntypedStorage(nbytes)
