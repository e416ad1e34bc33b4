"""A training set read from WebDataset-format shards, with the foundation's exact semantics.

The usual way to stream shards in DDP (``webdataset``, torchdata) gives each rank and worker its own shards. Then
the samples of a step depend on the number of ranks and workers, a rank with no shard hangs at the end of an epoch,
and a resume changes the stream. hpctrain keeps its one rule instead: the epoch's global order is a function of
(seed, epoch) alone, step k takes the k-th slice of it, rank r its part of the slice (:mod:`hpctrain.data.sampler`).
Shards make that affordable in two ways: a local order (:func:`shard_epoch_order`: the samples of any step lie in
one or two windows of a few MB, instead of anywhere in the data set) and block reads (:class:`BlockReader`: each
process opens each shard once and reads it forward in large blocks; no small-file metadata storm).

The price, written down in docs/data.md: every loader process reads the blocks of the windows it touches, so a node
reads the whole data set per epoch (the page cache serves the node's other processes), where rank-sharded streaming
reads 1/nodes of it. Exactness costs bandwidth, not metadata operations.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import re
import shlex
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from hpctrain.data.seeding import SALT_ORDER, generator
from hpctrain.data.shard_local import RankLayout, shard_local_order, shard_starts, shard_stream, window_shuffle
from hpctrain.data.shard_index import ShardIndex, load_shard_index, node_local_folder
from hpctrain.data.shards import INDEX, MANIFEST, WRITING
from hpctrain.data.staging import stage_split
from hpctrain.errors import UserError

if TYPE_CHECKING:
    from hpctrain.config.schema import DataSection

_CPP_LOCATION = re.compile(r"^\w+, \S+\.(?:cpp|cu|h):\d+, ")  # torchvision's "decode_image, /path/x.cpp:67, "
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "bmp")


class DataError(UserError):
    """An unreadable sample: corrupt image, missing member, label out of range. ``data.on_error=skip`` counts
    and skips these; otherwise they stop the run with this message."""


def shard_epoch_order(sizes: Sequence[int], seed: int, epoch: int, window: int, shuffle: bool = True) -> torch.Tensor:
    """The epoch's global sample order (indices into the concatenated shards).

    The shards are permuted per epoch and concatenated, and the samples are shuffled within windows of ``window``
    consecutive samples of that stream (window boundaries move every epoch, and a window spans shard boundaries). So
    the samples of any step lie in one or two windows, a few MB of one or two shards, instead of anywhere in the
    data set. This is WebDataset's shuffle buffer made deterministic: the same window shuffles the same way for any
    number of ranks and workers, and a resume needs only the step number."""
    total = int(sum(sizes))
    if not shuffle:
        return torch.arange(total)
    g = generator(SALT_ORDER, seed, epoch)
    stream = shard_stream(shard_starts(sizes), torch.randperm(len(sizes), generator=g).tolist())
    return window_shuffle(stream, window, g)


class BlockReader:
    """Reads byte ranges of shard files through an LRU cache of aligned blocks.

    Not shared between processes: each loader worker builds its own on first use (the
    dataset is pickled into workers without open files).

    A sample's bytes are located with the index and read through a per-process cache of large aligned blocks of the
    open shard files. Each process opens each shard once and reads it forward in blocks of ``block_bytes``; the
    small-file metadata storm of one file per sample disappears."""

    def __init__(self, paths: Sequence[Path], block_bytes: int, cache_bytes: int) -> None:
        self.paths = list(paths)
        self.block_bytes = block_bytes
        self.max_blocks = max(2, cache_bytes // block_bytes)
        self._files: OrderedDict[int, int] = OrderedDict()  # shard -> fd
        self._blocks: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self.opened = 0
        """Files opened by this process (for tests and the benchmark)."""
        self.reads = 0
        self.bytes_read = 0

    def read(self, shard: int, offset: int, size: int) -> bytes:
        b = self.block_bytes
        first, last = offset // b, (offset + size - 1) // b if size else offset // b
        parts = [self._block(shard, i) for i in range(first, last + 1)]
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        start = offset - first * b
        out = data[start : start + size]
        if len(out) != size:
            raise DataError(f"{self.paths[shard]}: {size} bytes expected at offset {offset}, the file ends before",
                            "the shard is truncated: re-create it or copy it again, then re-index (hpctrain shard --index-only).")
        return out

    def _block(self, shard: int, i: int) -> bytes:
        key = (shard, i)
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
            return block
        block = os.pread(self._fd(shard), self.block_bytes, i * self.block_bytes)
        self.reads += 1
        self.bytes_read += len(block)
        self._blocks[key] = block
        if len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
        return block

    def _fd(self, shard: int) -> int:
        fd = self._files.get(shard)
        if fd is None:
            try:
                fd = os.open(self.paths[shard], os.O_RDONLY)
            except OSError as err:
                raise DataError(f"cannot open shard {self.paths[shard]}: {err.strerror}",
                                "check that the shard directory is complete and readable on this node.") from None
            self.opened += 1
            self._files[shard] = fd
            if len(self._files) > 16:  # bound open files; shards are read in order, so old ones are done
                os.close(self._files.popitem(last=False)[1])
        else:
            self._files.move_to_end(shard)
        return fd

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
        self._blocks.clear()


def decode_member(ext: str, data: bytes) -> Any:
    """Bytes of one member -> a value, by WebDataset's extension conventions."""
    last = ext.rsplit(".", 1)[-1]
    if last in IMAGE_EXTS:
        from hpctrain.data.image_decode import decode_image

        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), "UNCHANGED")
    if last in ("cls", "cls2", "index", "label"):
        return int(data.decode("ascii").strip())
    if last == "json":
        return json.loads(data)
    if last in ("txt", "text"):
        return data.decode("utf-8")
    if last == "npy":
        return np.load(io.BytesIO(data), allow_pickle=False)
    return data


@dataclass(frozen=True)
class _Located:
    shard: int
    key: str
    members: dict[str, tuple[int, int]]


class ShardDataset(Dataset):
    """Map-style view of a split's shards: ``ds[i]`` is the tuple of the requested fields of sample i.

    ``fields`` follow webdataset's ``to_tuple``: extensions, with alternatives joined by
    ';' ("jpg;png"). ``decode=False`` returns raw bytes (as uint8 tensors) for image
    fields, for decoding on the GPU (:mod:`hpctrain.data.gpu_decode`). With ``stage_dir``
    the split is copied to that node-local folder first (:mod:`hpctrain.data.staging`)
    and read from there."""

    def __init__(
        self,
        split_dir: str | Path,
        fields: Sequence[str],
        *,
        num_classes: int = 0,
        window: int = 4096,
        block_bytes: int = 1 << 20,
        cache_bytes: int = 128 << 20,
        decode: bool = True,
        stage_dir: str = "",
    ) -> None:
        self.source_dir = Path(split_dir)
        self.split_dir = self.source_dir
        if stage_dir:
            index_path(self.source_dir)  # a missing or incomplete set is reported by its own path
            self.split_dir = stage_split(self.source_dir, stage_dir)
        self.fields = [f.split(";") for f in fields]
        self.num_classes = num_classes
        self.window = window
        self.block_bytes = block_bytes
        self.cache_bytes = cache_bytes
        self.decode = decode
        # Memory-mapped arrays (shard_index.py), not index.json's Python lists: ~100 bytes per sample parsed in
        # every rank and pickled into every loader worker would be gigabytes at millions of samples.
        self._index = open_shard_index(self.split_dir)
        self.shard_names = list(self._index.names)
        self.sizes = self._index.sizes()
        if not self.shard_names:
            raise UserError(f"{self.split_dir / INDEX} lists no shards", "create shards with hpctrain shard.")
        if len(self._index) == 0:
            raise UserError(f"the shards in {self.split_dir} hold no samples", "re-create them with hpctrain shard.")
        if not stage_dir:  # staging checked every size
            check_sizes_once_per_node(self.split_dir)
        self._reader: BlockReader | None = None

    def __len__(self) -> int:
        return len(self._index)

    def epoch_order(self, seed: int, epoch: int, shuffle: bool = True, layout: RankLayout | None = None) -> torch.Tensor:
        """Used by the step sampler in place of a full permutation (see the module docstring); with a ``layout``,
        data.order=shard_local's order for that many ranks (:mod:`hpctrain.data.shard_local`)."""
        if layout is not None:
            return shard_local_order(self.sizes, seed, epoch, self.window, layout, shuffle)
        return shard_epoch_order(self.sizes, seed, epoch, self.window, shuffle)

    @property
    def reader(self) -> BlockReader:
        if self._reader is None:
            self._reader = BlockReader([self.split_dir / n for n in self.shard_names], self.block_bytes, self.cache_bytes)
        return self._reader

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_reader"] = None  # open files and cached blocks stay in the process that made them
        return state

    def locate(self, i: int) -> _Located:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} outside 0..{len(self) - 1}")
        index = self._index
        shard = int(np.searchsorted(index.starts, i, side="right")) - 1
        members = {ext: (int(col[i, 0]), int(col[i, 1])) for ext, col in index.members.items() if col[i, 0] >= 0}
        return _Located(shard, index.key(i), members)

    def where(self, loc: _Located) -> str:
        return f"sample '{loc.key}' of shard {self.source_dir / self.shard_names[loc.shard]}"

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        loc = self.locate(i)
        return tuple(self._field(loc, alternatives) for alternatives in self.fields)

    def _field(self, loc: _Located, alternatives: list[str]) -> Any:
        ext = next((e for e in alternatives if e in loc.members), None)
        if ext is None:
            raise DataError(f"{self.where(loc)} has no {' or '.join('.' + e for e in alternatives)} member",
                            f"it has {sorted(loc.members)}; re-create the shards or fix the fields.")
        data = self.reader.read(loc.shard, *loc.members[ext])
        if not self.decode and ext.rsplit(".", 1)[-1] in IMAGE_EXTS:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        try:
            value = decode_member(ext, data)
        except Exception as err:  # torchvision raises RuntimeError for corrupt images
            reason = _CPP_LOCATION.sub("", str(err).strip().splitlines()[0] if str(err).strip() else "")[:200]
            raise DataError(f"{self.where(loc)}: cannot decode .{ext} ({type(err).__name__}: {reason})",
                            "the file is corrupt: re-create the shards from the source, or set data.on_error=skip.") from None
        if isinstance(value, int) and self.num_classes and not 0 <= value < self.num_classes:
            raise DataError(f"{self.where(loc)}: label {value} outside the {self.num_classes} classes 0..{self.num_classes - 1}",
                            "the shards belong to another data set, or their labels are wrong.")
        return value


def shard_dataset(split_dir: str | Path, fields: Sequence[str], data: DataSection, **kwargs: Any) -> ShardDataset:
    """A ShardDataset read as the run's data section says: shuffle window, read blocks and cache, staging."""
    return ShardDataset(split_dir, fields, window=data.shuffle_window, block_bytes=data.read_block_kb << 10,
                        cache_bytes=data.read_cache_mb << 20, stage_dir=data.stage_dir, **kwargs)


def check_sizes_once_per_node(split_dir: Path) -> None:
    """_check_sizes once per node and launch, not once per rank: the ranks of a node (same launch: torchrun's run id,
    or the Slurm job, step and restart) wait on a node-local lock, and the first leaves a marker for the others.
    10,000 shards on a parallel file system are 10,000 metadata operations; 8 ranks a node need not repeat them."""
    launch = [os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID",
                                                "SLURM_RESTART_COUNT")]
    if not any(launch):  # one process started by hand: nobody to share the check with
        _check_sizes(split_dir)
        return
    manifest = (split_dir / MANIFEST).stat()
    key = hashlib.sha256(json.dumps([str(split_dir.resolve()), manifest.st_size, manifest.st_mtime_ns, launch])
                         .encode()).hexdigest()[:24]
    folder = node_local_folder()
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / f"sizes-checked-{key}"
    with open(folder / f"sizes-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return
        _check_sizes(split_dir)
        marker.touch()
    _forget_old_markers(folder)


def _forget_old_markers(folder: Path, age_s: float = 86_400) -> None:
    """Each launch leaves a marker and a lock file: those of launches a day old go (a node's $TMPDIR is not ours
    to fill)."""
    cutoff = time.time() - age_s
    for path in folder.glob("sizes-*"):
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
        except OSError:  # another rank removed it first
            pass


def _check_sizes(split_dir: Path) -> None:
    """Each shard's size against the manifest (a stat each, no reading): a truncated copy or a shard
    rewritten after indexing is refused before training rather than failing mid-epoch."""
    manifest = json.loads((split_dir / MANIFEST).read_text())
    for shard in manifest.get("shards", []):
        path = split_dir / shard["name"]
        try:
            size = path.stat().st_size
        except OSError as err:
            raise UserError(f"shard {path} is listed in the manifest but cannot be read: {err.strerror}",
                            "copy the whole shard directory again.") from None
        if size != shard["bytes"]:
            raise UserError(f"shard {path} has {size} bytes, the manifest says {shard['bytes']}: it is truncated or was "
                            "rewritten after indexing", "copy it again, or re-create / re-index the shard set.")


def index_path(split_dir: Path) -> Path:
    """The split's index.json, after the checks that need no parsing; shards from another writer (no index yet)
    get a clear instruction."""
    if not split_dir.is_dir():
        raise UserError(f"shard directory {split_dir} does not exist", "create shards with: hpctrain shard SOURCE OUT --format ...")
    path = split_dir / INDEX
    if (split_dir / WRITING).exists():
        raise UserError(f"the shard set in {split_dir} is incomplete: its writer did not finish",
                        "re-create it with hpctrain shard (the shards there may be a part of the data set only).")
    if not path.exists():
        tars = list(split_dir.glob("*.tar"))
        if not tars:
            raise UserError(f"no shards in {split_dir} (no index.json and no .tar files)",
                            "create shards with: hpctrain shard SOURCE OUT --format ...")
        raise UserError(f"{split_dir} has {len(tars)} .tar shard(s) but no {INDEX}",
                        f"index them once (reads only the tar headers): {reindex_command(split_dir)}")
    if not (split_dir / MANIFEST).exists():
        raise UserError(f"{split_dir} has no {MANIFEST}: the shard set is incomplete (writing was interrupted?)",
                        "re-create it with hpctrain shard.")
    return path


def load_index(split_dir: Path) -> dict[str, Any]:
    """The split's index, parsed (index_path's checks first)."""
    path = index_path(split_dir)
    try:
        index = json.loads(path.read_text())
        shards = index["shards"]
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path} is not a valid shard index ({err})", f"re-index: {reindex_command(split_dir)}") \
            from None
    if not shards:
        raise UserError(f"{path} lists no shards", "create shards with hpctrain shard.")
    return index


def reindex_command(split_dir: Path) -> str:
    """The command that writes a split's index, quoted for pasting into a shell."""
    return shlex.join(["hpctrain", "shard", "--index-only", str(split_dir)])


def open_shard_index(split_dir: Path) -> ShardIndex:
    """The memory-mapped form of the split's index (shard_index.py), built from index.json when it is missing or
    older than index.json; a malformed index.json is reported as load_index reports it."""
    path = index_path(split_dir)
    try:
        return load_shard_index(split_dir, path)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(f"{path} is not a valid shard index ({type(err).__name__}: {err})",
                        f"re-index: {reindex_command(split_dir)}") from None
