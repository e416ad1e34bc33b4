"""A shard set's index as memory-mapped arrays, built once from index.json and shared by every process of a node.

index.json is what `hpctrain shard` writes and what other tools can read: a JSON list of shards with each sample's
key and member offsets. Parsed into Python objects it costs about 100 bytes per sample in every rank, and a loader
worker gets a pickled copy of it: at a million samples that is seconds of parsing per rank and hundreds of MB per
process (benchmarks/archive/2026-11/index_startup.py measured it). Here the same content is a few flat numpy
arrays written once as .npy files and opened with mmap: the page cache holds one copy per node, a worker receives
only their folder's path, and opening them costs microseconds.

The arrays live beside index.json (``.index-cache/``) when the shard folder is writable, else in a node-local
folder under the temporary directory ($TMPDIR). They are rebuilt when index.json changes (its size and mtime are
stamped in), and written to a temporary folder renamed into place: processes racing to build it agree on one.
numpy and the standard library only: no library of the field keeps a WebDataset index in this form.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CACHE_DIR = ".index-cache"
VERSION = 1


@dataclass(frozen=True)
class ShardIndex:
    """Samples are numbered shard by shard; sample i lies in shard bisect(starts, i) - 1."""

    folder: Path
    """Where the arrays are (pickled as this path alone: a worker opens them itself)."""
    names: tuple[str, ...]
    """Shard file names, in index order."""
    starts: np.ndarray
    """int64 [shards + 1]: the first sample number of each shard, then the total."""
    members: dict[str, np.ndarray]
    """Per member extension, int64 [samples, 2]: (offset, size) in its shard, (-1, -1) where absent."""
    key_bytes: np.ndarray
    """uint8: every sample key, UTF-8, one after another."""
    key_ends: np.ndarray
    """int64 [samples + 1]: where key i starts (key_ends[i]) and ends (key_ends[i + 1]) in key_bytes."""

    def __len__(self) -> int:
        return int(self.starts[-1])

    def key(self, i: int) -> str:
        return self.key_bytes[self.key_ends[i]:self.key_ends[i + 1]].tobytes().decode()

    def sizes(self) -> list[int]:
        return np.diff(self.starts).tolist()

    def __reduce__(self):
        return open_index, (self.folder,)


def load_shard_index(split_dir: Path, index_path: Path) -> ShardIndex:
    """The memory-mapped index of a split, built from index.json first if there is none for its current content."""
    stamp = _stamp(index_path)
    for folder in _candidate_folders(split_dir):
        if _current(folder, stamp):
            return open_index(folder)
    for folder in _candidate_folders(split_dir):
        try:
            _build(index_path, folder, stamp)
            return open_index(folder)
        except OSError:  # not writable here (a shared read-only data set): the next place
            continue
    raise OSError(f"no writable place for the index cache of {split_dir}")  # pragma: no cover - $TMPDIR unwritable


def open_index(folder: Path) -> ShardIndex:
    meta = json.loads((folder / "meta.json").read_text())

    def array(name: str) -> np.ndarray:
        return np.load(folder / f"{name}.npy", mmap_mode="r")

    return ShardIndex(folder=folder, names=tuple(meta["names"]), starts=array("starts"),
                      members={ext: array(f"member-{i}") for i, ext in enumerate(meta["exts"])},
                      key_bytes=array("key_bytes"), key_ends=array("key_ends"))


def _stamp(index_path: Path) -> dict[str, Any]:
    st = index_path.stat()
    return {"version": VERSION, "index": str(index_path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def node_local_folder() -> Path:
    """hpctrain's folder in this node's temporary directory ($TMPDIR): index copies and size-check markers."""
    return Path(tempfile.gettempdir()) / "hpctrain-index"


def _candidate_folders(split_dir: Path) -> list[Path]:
    """Beside the shards, then a node-local folder named for the split's absolute path."""
    digest = hashlib.sha256(str(split_dir.resolve()).encode()).hexdigest()[:16]
    return [split_dir / CACHE_DIR, node_local_folder() / digest]


def _current(folder: Path, stamp: dict[str, Any]) -> bool:
    try:
        return json.loads((folder / "meta.json").read_text())["stamp"] == stamp
    except (OSError, ValueError, KeyError):
        return False


def _build(index_path: Path, folder: Path, stamp: dict[str, Any]) -> None:
    shards = json.loads(index_path.read_text())["shards"]
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        exts = sorted({ext for s in shards for ext in s["members"]})
        sizes = [len(s["keys"]) for s in shards]
        starts = np.zeros(len(shards) + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        np.save(tmp / "starts.npy", starts)
        for i, ext in enumerate(exts):
            np.save(tmp / f"member-{i}.npy", _member_column(shards, ext, int(starts[-1])))
        keys = [k.encode() for s in shards for k in s["keys"]]
        ends = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum([len(k) for k in keys], out=ends[1:])
        np.save(tmp / "key_ends.npy", ends)
        np.save(tmp / "key_bytes.npy", np.frombuffer(b"".join(keys), dtype=np.uint8))
        meta = {"stamp": stamp, "names": [s["name"] for s in shards], "exts": exts}
        (tmp / "meta.json").write_text(json.dumps(meta))  # last: a folder without it is never read
        _replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _member_column(shards: list[dict[str, Any]], ext: str, total: int) -> np.ndarray:
    column = np.full((total, 2), -1, dtype=np.int64)
    row = 0
    for s in shards:
        n = len(s["keys"])
        col = s["members"].get(ext)
        if col is not None:
            column[row:row + n] = [c if c is not None else (-1, -1) for c in col]
        row += n
    return column


def _replace(tmp: Path, folder: Path) -> None:
    """Rename the finished folder into place. Another process may have put its own there first (same content):
    keep that one. A stale one (index.json changed) is moved aside first, then removed."""
    if folder.exists() and not _current(folder, json.loads((tmp / "meta.json").read_text())["stamp"]):
        stale = folder.with_name(f".{folder.name}.stale-{os.getpid()}")
        try:
            folder.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass
    try:
        tmp.rename(folder)
    except OSError:
        if not folder.exists():
            raise
