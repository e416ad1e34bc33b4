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
    the Checkpointer waits for that write before it takes the next snapshot."""

    def __init__(self) -> None:
        self._buffers: list[torch.UntypedStorage] = []

    def snapshot(self, obj: Any) -> Any:
        """A deep copy of a state dict tree whose tensors live on the CPU in memory of their own.

        copy.deepcopy keeps every other sharing intact (the same betas tuple in two optimizer param
        groups, the state dict's `_metadata`), which torch.save's pickle memo would otherwise write
        differently; the tensors are put into its memo beforehand as CPU copies. Device-to-host copies
        are synchronous: the copy must be complete before training changes the live tensors."""
        spare, used = list(reversed(self._buffers)), []
        storages: dict[int, torch.UntypedStorage] = {}
        memo: dict[int, Any] = {}
        for t in _tensors(obj):
            if id(t) not in memo:
                memo[id(t)] = _copy_tensor(t, storages, spare, used)
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


def _copy_tensor(t: torch.Tensor, storages: dict[int, torch.UntypedStorage], spare: list[torch.UntypedStorage],
                 used: list[torch.UntypedStorage]) -> torch.Tensor:
    src = t.untyped_storage()
    key = src.data_ptr()
    if src.nbytes() == 0:  # empty storages share data_ptr 0: never memoised
        stored = torch.UntypedStorage(0)
    elif key in storages:
        stored = storages[key]
    else:
        # The state has the same storages in the same order at every save: the buffer that held this
        # storage's bytes last time is next in line; anything else gets fresh memory.
        stored = spare.pop() if spare and spare[-1].nbytes() == src.nbytes() else torch.UntypedStorage(src.nbytes())
        stored.copy_(src)  # from CUDA a device-to-host copy
        storages[key] = stored
        used.append(stored)
    view = torch.empty(0, dtype=t.dtype)
    view.set_(stored, t.storage_offset(), t.size(), t.stride())
    return view
