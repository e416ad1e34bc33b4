"""On-disk checkpoint format: torch.distributed.checkpoint (DCP) inside hpctrain's integrity layer.

    RUN_DIR/checkpoints/
        step_00000120/  dcp/ (DCP: .metadata and each rank's __R_N.distcp, tensors by parameter name), train.pt
                        (scheduler, scaler, EMA count, experiment state), rng.pt (every rank's streams), state.json
                        (step, epoch, data position, world size, strategy), config.toml, manifest.json (written
                        last: schema, sizes and sha256 of every file, each rank hashing the files it wrote)
        latest          name of the newest complete checkpoint, written after it

A save is written into a hidden temporary directory and renamed into place only after every rank's files and the
manifest are on disk, then ``latest`` is replaced atomically. A checkpoint is valid only if its manifest exists and
every file has the recorded size and checksum, so a crash, a full disk or a truncated copy is detected on load and
the previous checkpoint is used instead. Schema 1 (before DCP: optimizer state keyed by parameter position, so it
cannot be resharded) is not read; see OLD_FORMAT_HINT.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from hpctrain.atomic import atomic_write_text, fsync_dir
from hpctrain.errors import UserError

SCHEMA_VERSION = 2
OLD_FORMAT_HINT = ("it was written by an hpctrain from before torch.distributed.checkpoint (schema 1), which this "
                   "version does not read: finish that run with the hpctrain version that started it (its "
                   "'hpctrain export' writes the weights as safetensors), or start a new run.dir.")
MANIFEST = "manifest.json"
LATEST = "latest"
PREFIX = "step_"
TMP_PREFIX = ".tmp-"


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


class _HashingWriter:
    """File wrapper that hashes what torch.save writes, so the checksum costs no second read."""

    def __init__(self, f) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.size += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def _write_file(path: Path, payload: Any) -> dict[str, Any]:
    with open(path, "wb") as f:
        w = _HashingWriter(f)
        if isinstance(payload, (bytes, str)):
            w.write(payload.encode() if isinstance(payload, str) else payload)
        else:
            torch.save(payload, w)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": w.size, "sha256": w.sha.hexdigest()}


def new_temporary(root: Path, step: int) -> Path:
    """The hidden directory a save of ``step`` is written into (rank 0 makes it; every rank writes into it)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def hash_file(path: Path) -> dict[str, Any]:
    """Size and sha256 of a file, as the manifest records them."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
            size += len(block)
    return {"bytes": size, "sha256": sha.hexdigest()}


def write_files(tmp: Path, files: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Write ``files`` (name -> object for torch.save, or str/bytes written as they are) into ``tmp``, fsynced;
    returns their manifest entries (hashed while written: no second read)."""
    return {name: _write_file(tmp / name, payload) for name, payload in files.items()}


class CommitRefused(Exception):
    """The caller's ``commit_allowed`` said no right before the rename: the checkpoint was not committed."""


def finish_checkpoint(root: Path, tmp: Path, step: int, entries: Mapping[str, Any], meta: Mapping[str, Any],
                      commit_allowed: Callable[[], str] | None = None) -> Path:
    """Write the manifest (last), rename ``tmp`` into place, then point ``latest`` at it; returns the checkpoint
    directory. Raises OSError with the previous checkpoint intact (``tmp`` is removed). ``commit_allowed`` is asked
    right before the rename: a non-empty answer (why not) raises CommitRefused, ``tmp`` removed, nothing moved (the
    run dir lock lost while the save was written: another training may own the run dir now)."""
    final = root / step_dir_name(step)
    try:
        manifest = {"schema": SCHEMA_VERSION, "step": step, "created": time.time(), **meta,
                    "files": dict(sorted(entries.items()))}
        _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        for sub in {Path(name).parent for name in entries} - {Path(".")}:
            fsync_dir(tmp / sub)
        fsync_dir(tmp)
        refused = commit_allowed() if commit_allowed is not None else ""
        if refused:
            raise CommitRefused(refused)
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(root / LATEST, final.name + "\n")
    return final


def write_checkpoint(root: Path, step: int, files: Mapping[str, Any], meta: Mapping[str, Any]) -> Path:
    """A whole checkpoint written by one process (tests, tools): new_temporary, write_files, finish_checkpoint."""
    tmp = new_temporary(root, step)
    try:
        entries = write_files(tmp, files)
    except BaseException:
        discard(tmp)
        raise
    return finish_checkpoint(root, tmp, step, entries, meta)


def discard(tmp: Path) -> None:
    """Drop an unfinished save's directory."""
    shutil.rmtree(tmp, ignore_errors=True)


def _replace_dir(tmp: Path, final: Path) -> None:
    old = None
    if final.exists():  # the same step saved again (e.g. after a resume): swap, then drop the old one
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class Checked:
    path: Path
    manifest: dict[str, Any] | None
    problem: str  # '' when valid

    @property
    def valid(self) -> bool:
        return not self.problem


def check_checkpoint(path: Path, verify_checksums: bool = True) -> Checked:
    """Is this checkpoint directory complete and intact? Says what is wrong when not."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return Checked(path, None, "no manifest (the save did not finish)")
    except (OSError, ValueError) as err:
        return Checked(path, None, f"unreadable manifest ({err})")
    if manifest.get("schema") == 1:
        return Checked(path, manifest, f"schema version 1: {OLD_FORMAT_HINT}")
    if manifest.get("schema") != SCHEMA_VERSION:
        return Checked(path, manifest, f"schema version {manifest.get('schema')} (this hpctrain reads {SCHEMA_VERSION})")
    for name, entry in manifest.get("files", {}).items():
        problem = _check_file(path / name, entry, verify_checksums)
        if problem:
            return Checked(path, manifest, f"{name}: {problem}")
    return Checked(path, manifest, "")


def _check_file(path: Path, entry: Mapping[str, Any], verify_checksums: bool) -> str:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != entry["bytes"]:
        return f"{size} bytes, expected {entry['bytes']} (truncated or replaced)"
    if verify_checksums and hash_file(path)["sha256"] != entry["sha256"]:
        return "checksum mismatch (corrupted)"
    return ""


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories, newest step first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def find_latest_valid(root: Path, verify_checksums: bool = True) -> tuple[Checked | None, list[Checked]]:
    """The newest valid checkpoint (the ``latest`` pointer first) and the ones skipped on the way."""
    candidates = list_checkpoints(root)
    pointed = _read_latest(root)
    if pointed is not None and pointed in candidates:
        candidates.remove(pointed)
        candidates.insert(0, pointed)
    skipped: list[Checked] = []
    for path in candidates:
        checked = check_checkpoint(path, verify_checksums)
        if checked.valid:
            return checked, skipped
        skipped.append(checked)
    return None, skipped


def _read_latest(root: Path) -> Path | None:
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        return None
    return root / name if name.startswith(PREFIX) else None


def load_file(path: Path, name: str) -> Any:
    """torch.load with weights_only=True: a checkpoint cannot run code on load."""
    try:
        return torch.load(path / name, map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling errors have many types; all mean the same to the user
        raise _unloadable(path, name, err) from None


def read_bytes(path: Path, name: str) -> bytes:
    """A checkpoint file's bytes, as they are on disk (what load_file would torch.load). The one read of a
    checkpoint file in a distributed resume: rank 0 reads, the other ranks receive the bytes."""
    return (path / name).read_bytes()


def load_bytes(data: bytes | bytearray | memoryview, path: Path, name: str) -> Any:
    """load_file for bytes read elsewhere (same map_location and weights_only, same error)."""
    try:
        return torch.load(_BufferReader(data), map_location="cpu", weights_only=True)
    except Exception as err:
        raise _unloadable(path, name, err) from None


class _BufferReader(io.RawIOBase):
    """A seekable file over a buffer, without a copy of it: io.BytesIO copies a bytearray, and a resume then held
    the file's size three times over on every rank (received bytes, their copy, the loaded tensors)."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        super().__init__()
        self._view, self._pos = memoryview(data).cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        n = max(0, min(len(buffer), len(self._view) - self._pos))
        memoryview(buffer).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def _unloadable(path: Path, name: str, err: Exception) -> UserError:
    return UserError(
        f"cannot load {name} from checkpoint '{path}': {err}",
        "the file passed its checksum, so it was written by another hpctrain/torch version or by hand; "
        "resume from another checkpoint (ckpt.resume=PATH) or start a new run.dir.",
    )


def remove_stale_temporaries(root: Path) -> None:
    """Half-written saves of crashed runs: never valid, safe to drop."""
    for p in root.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(p, ignore_errors=True)
