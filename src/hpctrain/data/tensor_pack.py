"""A data set of many tensors, sent to loader workers as one shared-memory block.

torch pickles each tensor storage that a worker's data set holds as a shared-memory file descriptor of its own, and
a worker receives its data set when it starts. forkserver passes all of a start's descriptors in one message, which
multiprocessing limits to 256 (`ValueError: too many fds`; a higher RLIMIT_NOFILE does not change that); spawn
passes them all too, and each stays open in the rank and in every worker. A data set of variable-length samples
(speech: thousands of 1-D tensors) has one storage per sample. Packed, its storages travel as one block, one
descriptor, and each tensor is rebuilt in the worker as a view into it.

Every worker start pickles the data set again (pack() is called from the start's own pickling), so each worker gets
the data set as it is then. The block is made once: the rank's own tensors become views into it, so one copy of the
data stays in memory and a tensor changed in place in the rank is changed for the workers too (pack says more).
Measurements against torch's file_system strategy: BENCHMARKS.md, "Moved from module docstrings (issue 39)".
"""

from __future__ import annotations

import contextlib
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

PACK_ABOVE = 64
"""Storages in a data set above which they are copied into one block. At or below, each storage is sent as it is,
moved into shared memory in place (no copy), as torch would: their few descriptors fit any start method."""
_ALIGN = 64  # every storage starts at a multiple of any element size, so each view's offset is exact

View = tuple  # (index of its storage in the blocks sent, offset in elements, shape, stride, dtype)
Packed = tuple  # (skeleton: bytes, blocks: [shared UntypedStorage], views: [View])


class _Packer(ForkingPickler):
    """Pickles an object with its packable tensors left out: each becomes a persistent id, its index in tensors."""

    def __init__(self, file: io.BytesIO, protocol: int) -> None:
        super().__init__(file, protocol)
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> int | None:
        # Called for every object pickled: the type test comes first, and the id is a plain int (a tuple's items
        # would each come back here).
        if type(obj) is not torch.Tensor or not packable(obj):
            return None
        self.tensors.append(obj)
        return len(self.tensors) - 1


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, blocks: list, views: list[View]) -> None:
        super().__init__(file)
        self.blocks = blocks
        self.views = views

    def persistent_load(self, pid: int) -> torch.Tensor:
        block, offset, shape, stride, dtype = self.views[pid]
        return torch.empty(0, dtype=dtype).set_(self.blocks[block], offset, shape, stride)


def packable(obj: torch.Tensor) -> bool:
    """A plain dense CPU tensor, whose view into the block is the same tensor. Others (parameters, subclasses,
    tensors that need gradients, quantized or conjugated ones) are pickled by torch as before."""
    return (type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided
            and not obj.requires_grad and not obj.is_quantized and not obj.is_conj() and not obj.is_neg())


def pack(obj: Any) -> Packed:
    """(the object pickled without its plain tensors, the shared storages that hold them, where each tensor lies in
    them). Call it while a process start pickles (forkserver, spawn), and send the result with that start only:
    other objects are pickled as multiprocessing would there, some as descriptors of that start.

    At most PACK_ABOVE storages are sent as they are (torch's reduction moves each into shared memory in place when
    the result is pickled); more are copied into one new block, and each of those tensors is made a view into it.

    Whatever the pickle holds besides the packed tensors (a parameter, a tensor that needs gradients: torch sends
    each as a descriptor of this start) is valid for that start only and never reused. The rank's tensors become
    views into the block as torch's own sharing moves a storage into shared memory in place; a later start finds the
    tensors in one storage and sends it as it is (no copy). A tensor outside the data set that shared a storage with
    one inside keeps the old storage: a change through it no longer reaches the data set. The cost: a copy of the
    tensors' bytes into the block at the first start, and a small time per tensor to pack (in the rank) and to
    rebuild (in each worker)."""
    buffer = io.BytesIO()
    packer = _Packer(buffer, pickle.HIGHEST_PROTOCOL)
    packer.dump(obj)
    storages: dict[int, torch.UntypedStorage] = {}  # a storage's address -> the storage (views share one)
    for tensor in packer.tensors:
        storages.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage())
    if len(storages) <= PACK_ABOVE:
        index = {address: i for i, address in enumerate(storages)}
        views = [(index[t.untyped_storage().data_ptr()], t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
                 for t in packer.tensors]
        return buffer.getvalue(), list(storages.values()), views
    offsets, size = {}, 0  # a storage's address -> its byte offset in the block
    for address, storage in storages.items():
        offsets[address] = size
        size += -(-storage.nbytes() // _ALIGN) * _ALIGN
    block = torch.empty(max(size, 1), dtype=torch.uint8).share_memory_()  # an empty one cannot be mapped
    for address, storage in storages.items():
        block[offsets[address]:offsets[address] + storage.nbytes()].copy_(
            torch.empty(0, dtype=torch.uint8).set_(storage))
    shared = block.untyped_storage()
    views = [(0, offsets[t.untyped_storage().data_ptr()] // t.element_size() + t.storage_offset(), tuple(t.shape),
              t.stride(), t.dtype) for t in packer.tensors]
    for tensor, (_, offset, shape, stride, _) in zip(packer.tensors, views):
        _repoint(tensor, shared, offset, shape, stride)
    return buffer.getvalue(), [shared], views


def _repoint(tensor: torch.Tensor, storage: torch.UntypedStorage, offset: int, shape: tuple, stride: tuple) -> None:
    """The rank's tensor becomes its view into the block, as in the workers (one copy of the data, shared)."""
    try:
        with torch.inference_mode() if tensor.is_inference() else contextlib.nullcontext():
            tensor.set_(storage, offset, shape, stride)
    except RuntimeError:  # torch refuses this one: it keeps its own storage, copied into a block at each start
        pass


def unpack(skeleton: bytes, blocks: list, views: list[View]) -> Any:
    """The object pack() took, its tensors views into ``blocks``."""
    return _Unpacker(io.BytesIO(skeleton), blocks, views).load()
