"""WebDataset-format tar shards: writing them, and the index that makes them randomly addressable.

A shard is a plain POSIX tar whose members are named ``KEY.EXT`` (``000123.jpg``, ``000123.cls``); the members of
one sample are consecutive. That is the WebDataset convention, so the ``webdataset`` library reads these shards and
hpctrain reads its. Beside the shards of a split lie ``index.json`` (per shard, the sample keys and each member's
byte offset and size: any rank reads any sample with one ``pread``, which makes exact, world-size independent
batches possible, see :mod:`hpctrain.data.shardset`) and ``manifest.json`` (per shard, SHA-256, bytes and sample
count, and how the set was made; written last: a split without it is incomplete).

Written with the standard library's ``tarfile`` rather than ``webdataset.ShardWriter`` because the writer must also
be atomic per shard (a temporary name, then rename), make byte-identical shards from identical input (fixed
mtime/owner), and record offsets and checksums in the same pass. Shards from other writers are indexed by
:func:`index_tar`, which reads only the tar headers.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from hpctrain.atomic import atomic_write_text, fsync_dir
from hpctrain.errors import UserError

INDEX = "index.json"
MANIFEST = "manifest.json"
WRITING = ".writing"  # present while a writer fills the directory
FORMAT = "hpctrain-shards/1"

def split_member_name(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the file name, the rest the extension."""
    directory, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        return "", ""
    return (f"{directory}/{stem}" if directory else stem), ext.lower()


@dataclass
class ShardEntry:
    """One shard in the index: where each sample's members lie."""

    name: str
    """File name, relative to the split directory."""
    keys: list[str] = field(default_factory=list)
    """Sample keys in file order."""
    members: dict[str, list[list[int] | None]] = field(default_factory=dict)
    """extension -> per sample [data offset, size] (None where that sample lacks the extension)."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "keys": self.keys, "members": self.members}


def index_tar(path: Path) -> ShardEntry:
    """Index a WebDataset tar from its headers. Raises UserError on a truncated or non-tar file."""
    entry = ShardEntry(path.name)
    seen: set[str] = set()
    try:
        with tarfile.open(path, mode="r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                key, ext = split_member_name(info.name)
                if not key or key.startswith(".") or ext.startswith("__"):
                    continue  # hidden files, webdataset metadata
                if info.offset_data + info.size > path.stat().st_size:
                    raise tarfile.ReadError(f"member {info.name} runs past the end of the file")
                if not entry.keys or entry.keys[-1] != key:
                    if key in seen:
                        raise UserError(f"{path}: the members of sample '{key}' are not consecutive",
                                        "WebDataset needs a sample's files next to each other; re-create the shard.")
                    seen.add(key)
                    entry.keys.append(key)
                    for column in entry.members.values():
                        column.append(None)
                column = entry.members.setdefault(ext, [None] * len(entry.keys))
                column[-1] = [info.offset_data, info.size]
            end = tar.offset
        with open(path, "rb") as f:  # a whole tar ends with two zero blocks; tarfile stops quietly without them
            f.seek(end)
            if f.read(1024) != bytes(1024):
                raise tarfile.ReadError("no end-of-archive marker after the last member")
    except (tarfile.ReadError, EOFError, OSError) as err:
        raise UserError(f"{path} is not a readable tar file ({err})",
                        "the shard is truncated or corrupt: re-create it (hpctrain shard) or copy it again.") from None
    return entry


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def write_index(split_dir: Path, entries: list[ShardEntry], extra: Mapping[str, Any] | None = None) -> None:
    """index.json, then manifest.json (checksums): the manifest's presence marks a complete split."""
    shards = [e.to_json() for e in entries]
    atomic_write_text(split_dir / INDEX, json.dumps({"format": FORMAT, "shards": shards}, separators=(",", ":")))
    manifest = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "samples": sum(len(e.keys) for e in entries),
        "shards": [
            {"name": e.name, "samples": len(e.keys), "bytes": (split_dir / e.name).stat().st_size,
             "sha256": sha256_file(split_dir / e.name)}
            for e in entries
        ],
        **(extra or {}),
    }
    atomic_write_text(split_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def index_directory(split_dir: Path, extra: Mapping[str, Any] | None = None) -> int:
    """Index every ``*.tar`` of a directory (shards written by another tool); returns the sample count."""
    tars = sorted(split_dir.glob("*.tar"))
    if not tars:
        raise UserError(f"no .tar shards in {split_dir}", "point at the directory that holds the shards.")
    entries = [index_tar(t) for t in tars]
    write_index(split_dir, entries, extra)
    return sum(len(e.keys) for e in entries)


class ShardWriter:
    """Writes samples (``{"__key__": str, ext: bytes}``) into tars of at most ``max_bytes`` each.

    Each shard is written under a temporary name and renamed when closed, so a crash
    leaves whole shards only; the index and manifest come at :meth:`close`."""

    def __init__(self, split_dir: Path, prefix: str, max_bytes: int, extra: Mapping[str, Any] | None = None) -> None:
        self.split_dir = split_dir
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.extra = dict(extra or {})
        self.entries: list[ShardEntry] = []
        self._tar: tarfile.TarFile | None = None
        self._tmp: Path | None = None
        self._final: Path | None = None
        split_dir.mkdir(parents=True, exist_ok=True)
        (split_dir / MANIFEST).unlink(missing_ok=True)
        (split_dir / WRITING).write_text("a writer is filling this directory; it is complete once manifest.json exists\n")

    def write(self, sample: Mapping[str, Any]) -> None:
        key = sample["__key__"]
        if "." in key.rpartition("/")[2]:
            raise ValueError(f"sample key '{key}' contains a dot; WebDataset would split it")
        files = [(f"{key}.{ext}", _as_bytes(v)) for ext, v in sample.items() if ext != "__key__"]
        size = sum(512 + -(-len(data) // 512) * 512 for _, data in files)
        if self._tar is None or (self._tar.offset + size > self.max_bytes and self._tar.offset > 0):
            self._roll()
        assert self._tar is not None
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o444  # fixed: same input, same bytes
            self._tar.addfile(info, io.BytesIO(data))

    def _roll(self) -> None:
        self._finish_shard()
        self._final = self.split_dir / f"{self.prefix}-{len(self.entries):06d}.tar"
        self._tmp = self._final.with_name(f".{self._final.name}.tmp")
        self._tar = tarfile.open(self._tmp, mode="w", format=tarfile.USTAR_FORMAT)

    def _finish_shard(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        assert self._tmp is not None and self._final is not None
        with open(self._tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(self._tmp, self._final)
        self.entries.append(index_tar(self._final))
        self._tar = None

    def close(self) -> int:
        """Finish the last shard and write the index and manifest; returns the number of samples."""
        self._finish_shard()
        fsync_dir(self.split_dir)
        write_index(self.split_dir, self.entries, self.extra)
        (self.split_dir / WRITING).unlink(missing_ok=True)
        return sum(len(e.keys) for e in self.entries)

    def abort(self) -> None:
        """Drop the shard in progress (its temporary file); whole shards written so far stay."""
        if self._tar is not None:
            self._tar.close()
            self._tar = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, int):
        return str(value).encode()  # webdataset's .cls convention: the decimal label
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def write_split(split_dir: Path, prefix: str, samples: Iterable[Mapping[str, Any]], max_bytes: int,
                extra: Mapping[str, Any] | None = None) -> int:
    """Write all samples as shards, or nothing complete: on an error the manifest is not written."""
    writer = ShardWriter(split_dir, prefix, max_bytes, extra)
    try:
        for sample in samples:
            writer.write(sample)
    except BaseException:
        writer.abort()
        raise
    return writer.close()
