"""Node-local staging (``data.stage_dir``): a split's shards are copied once per node, then read locally.

Without it a node reads up to the whole split from the shared filesystem each epoch (docs/data.md, "Data at cluster
scale"), competing with every other job; a node-local disk ($TMPDIR, an NVMe) serves the same reads after one
sequential copy per node. The copy is made so that nothing half-done is ever read (stage_split says how): one
copier per node under a lock the kernel releases if it dies, a folder per set and manifest, each shard verified
against the manifest before it gets its name (so a requeued copy resumes), the manifest last, and the free space
checked before anything is copied.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import socket
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from hpctrain.atomic import atomic_write_bytes, fsync_dir
from hpctrain.data.shards import INDEX, MANIFEST
from hpctrain.dist.env import expand_path
from hpctrain.errors import UserError
from hpctrain.filesystems import NETWORK_FS, filesystem_type
from hpctrain.units import format_size

log = logging.getLogger("hpctrain")

STAGE_FOLDER = "hpctrain-stage"
LOCK = ".stage.lock"
PART = ".part"
CHUNK = 8 << 20
# A single stream from Lustre or GPFS reaches a fraction of a node's network bandwidth; a few shards in flight
# fill it. hashlib and file reads release the GIL, so threads suffice.
COPY_THREADS = 4
PROGRESS_EVERY_S = 10.0


def stage_split(split_dir: Path, stage_dir: str) -> Path:
    """The staged copy of ``split_dir`` under ``stage_dir`` (expanded here, on the node that reads it), copied
    first where it is missing or incomplete. ``split_dir`` must be a complete split (shardset.index_path).

    How. The exact order costs about min(nodes, 1 + block / sample size) x the split per epoch from the shared file
    system. One copier per node: the node's processes take a lock (``flock``) in the staged folder; the first
    copies, the others wait in ``flock`` and then find the work done. The kernel releases the lock of a process that
    dies, so the next waiter resumes instead of hanging. Nodes copy independently. Layout:
    ``STAGE_DIR/hpctrain-stage/<parent>-<split>-<hash of its path>/<hash of its manifest>/``: two sets never share a
    folder, and a rewritten set (new manifest) is a new folder, never mixed with the old copy. Verified, resumable:
    each shard is copied under a temporary name, hashed while copied, checked against the manifest's SHA-256 and
    size, fsynced, and renamed to its name: a shard under its final name was verified when it got it, so a resumed
    or requeued copy reuses it after a ``stat`` of its size. index.json, then manifest.json come last; the
    manifest's presence marks a complete copy (as in the shard writer), which later processes and later jobs on the
    node accept without the lock. No half-filled disk: the free space is checked (statvfs) before anything is
    copied."""
    root = stage_root(stage_dir)
    source = split_dir.resolve()
    manifest_bytes = (source / MANIFEST).read_bytes()
    manifest = _parse_manifest(source, manifest_bytes)
    target = staged_folder(source, manifest_bytes, root)
    if _complete(target, manifest):  # lock-free: the manifest is written last
        log.info("reading %s from the copy staged earlier on this node, %s", source, target)
        return target
    try:
        target.mkdir(parents=True, exist_ok=True)
        lock = open(target / LOCK, "a")
    except OSError as err:
        raise UserError(f"cannot create {target} to stage {source}: {err.strerror}",
                        "make data.stage_dir a folder this job may write to, on every node (e.g. with your user "
                        "name in it on a disk that users share).") from None
    with lock:  # closing it releases the lock
        _take_node_lock(lock.fileno(), target, source, sum(s["bytes"] for s in manifest["shards"]))
        if not _complete(target, manifest):  # the process that held the lock may have finished it
            _copy_split(source, target, manifest, manifest_bytes)
    return target


def stage_root(stage_dir: str) -> Path:
    """data.stage_dir as a path on this node ($VARIABLES and ~ expanded); it must exist."""
    root = Path(expand_path(stage_dir, "data.stage_dir"))
    shown = f"{stage_dir} ({root})" if str(root) != stage_dir else stage_dir
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise UserError(f"data.stage_dir {shown} {what} on {socket.gethostname()}",
                        "point it at a node-local folder that exists on every node ($TMPDIR, a local NVMe mount), "
                        "or leave data.stage_dir empty to read the shards where they are.")
    fs = filesystem_type(root)
    if fs in NETWORK_FS:
        # Besides copying from one shared filesystem to another: flock there is often per node (BeeGFS, Lustre's
        # localflock, NFS with local_lock) or missing, so the nodes' copiers would write the same files at once.
        raise UserError(f"data.stage_dir {shown} is on a {fs} filesystem shared over the network: staging copies the "
                        "shards to a node-local disk", "point data.stage_dir at a node-local disk ($TMPDIR, a local "
                        "NVMe mount), or leave it empty to read the shards where they are.")
    return root


def staged_folder(source: Path, manifest_bytes: bytes, root: Path) -> Path:
    """Where ``source`` (absolute) is staged under ``root``: a folder per split path, a subfolder per manifest."""
    readable = re.sub(r"[^\w.-]+", "_", "-".join(source.parts[-2:]))[-64:]
    return root / STAGE_FOLDER / f"{readable}-{_digest(str(source).encode())}" / _digest(manifest_bytes)


def free_bytes(path: Path) -> int:
    """Space an unprivileged process may still write where ``path`` is."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _parse_manifest(source: Path, data: bytes) -> dict[str, Any]:
    try:
        manifest = json.loads(data)
        if not all(isinstance(s["name"], str) and isinstance(s["bytes"], int) for s in manifest["shards"]):
            raise ValueError("a shard without a name or a byte count")
        return manifest
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"{source / MANIFEST} is not a valid shard manifest ({type(err).__name__}: {err})",
                        "re-index the shards: " + shlex.join(["hpctrain", "shard", "--index-only", str(source)])) \
            from None


def _complete(target: Path, manifest: dict[str, Any]) -> bool:
    """A finished copy whose shards all still have their size (a stat each: the disk is local)."""
    if not (target / MANIFEST).exists() or not (target / INDEX).exists():
        return False
    return all(_size(target / s["name"]) == s["bytes"] for s in manifest["shards"])


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1


def _take_node_lock(fd: int, target: Path, source: Path, total: int) -> None:
    """Held by the process that copies; the kernel releases it when that process ends, however it ends."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        _wait_for_lock(fd, target, source, total)
    except OSError as err:  # ENOLCK, ENOSYS: a filesystem without locks is not a node-local disk
        raise UserError(f"cannot lock {target} to stage {source}: {err.strerror}",
                        "point data.stage_dir at a node-local disk ($TMPDIR, a local NVMe mount), or leave it empty "
                        "to read the shards where they are.") from None


def _wait_for_lock(fd: int, target: Path, source: Path, total: int) -> None:
    """Block in flock (in a helper thread) while this thread says how far the copy has got: the copier may be a
    rank that logs warnings only, and rank 0 should not wait minutes in silence."""
    started, got, failed = time.monotonic(), threading.Event(), []

    def take() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:  # pragma: no cover - flock on an open file does not fail
            failed.append(err)
        finally:
            got.set()

    threading.Thread(target=take, name="stage-lock", daemon=True).start()
    log.info("another process of this node is staging %s; waiting for it", source)
    while not got.wait(PROGRESS_EVERY_S):
        log.info("waiting for the staged copy of %s: %s of %s there", source, format_size(_staged_bytes(target)),
                 format_size(total))
    if failed:
        raise failed[0]
    log.info("waited %.1f s for the staged copy of %s", time.monotonic() - started, source)


def _staged_bytes(target: Path) -> int:
    """Bytes in the staged folder so far, temporary files included (a copier renames them meanwhile)."""
    total = 0
    for path in target.iterdir():
        try:
            total += path.stat().st_size if path.is_file() else 0
        except FileNotFoundError:
            pass
    return total


def _copy_split(source: Path, target: Path, manifest: dict[str, Any], manifest_bytes: bytes) -> None:
    """Copy what is missing (under the lock). A dead copier's temporary files go; its finished shards stay."""
    (target / MANIFEST).unlink(missing_ok=True)  # incomplete while shards are repaired
    for part in target.rglob(f".*{PART}"):
        part.unlink()
    todo = _shards_to_copy(target, manifest["shards"])
    reused = len(manifest["shards"]) - len(todo)
    need = sum(s["bytes"] for s in todo) + _size(source / INDEX) + len(manifest_bytes)
    _check_space(source, target, need)
    _mention_old_copies(source, target)
    started = time.monotonic()
    _copy_shards(source, target, todo)
    _copy_file(source / INDEX, target / INDEX, None, _Progress(source, 0), threading.Event())
    try:
        atomic_write_bytes(target / MANIFEST, manifest_bytes)  # last: the copy is complete
        fsync_dir(target)
    except OSError as err:
        raise _copy_error(source / MANIFEST, target / MANIFEST, err) from None
    seconds, copied = time.monotonic() - started, sum(s["bytes"] for s in todo)
    log.info("staged %s in %s: %d shard(s), %s copied in %.1f s (%s/s); %d shard(s) already there reused",
             source, target, len(todo), format_size(copied), seconds, format_size(copied / max(seconds, 1e-3)), reused)


def _shards_to_copy(target: Path, shards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Shards not yet staged. A staged shard of the wrong size (a disk error, someone's hand) goes and is copied
    again: its name says it was verified once, its size says it changed since."""
    todo = []
    for shard in shards:
        path, size = target / shard["name"], _size(target / shard["name"])
        if size == shard["bytes"]:
            continue
        if size >= 0:
            log.warning("staged shard %s has %d bytes, the manifest says %d: copying it again", path, size,
                        shard["bytes"])
            path.unlink()
        todo.append(shard)
    return todo


def _check_space(source: Path, target: Path, need: int) -> None:
    free = free_bytes(target)
    if need > free:
        raise UserError(f"not enough space to stage {source} on {socket.gethostname()}: {format_size(need)} to copy, "
                        f"{format_size(free)} free in {target.parents[2]}",
                        "point data.stage_dir at a larger node-local disk, delete staged copies no job uses there "
                        f"({target.parents[1]}), or leave data.stage_dir empty to read the shards where they are.")


def _mention_old_copies(source: Path, target: Path) -> None:
    """Copies of earlier versions of this split stay (a job still running on this node may read one): say so."""
    old = [p for p in target.parent.iterdir() if p.is_dir() and p != target]
    if old:
        size = sum(f.stat().st_size for p in old for f in p.rglob("*") if f.is_file())
        log.info("%d staged copy(ies) of an earlier version of %s are in %s (%s): delete them once no job on this "
                 "node reads them", len(old), source, target.parent, format_size(size))


def _copy_shards(source: Path, target: Path, todo: list[dict[str, Any]]) -> None:
    """Copy in COPY_THREADS threads; this thread reports progress. On the first error the others stop at their
    next chunk and remove their temporary files."""
    progress, stop = _Progress(source, sum(s["bytes"] for s in todo)), threading.Event()
    with ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="stage") as pool:
        pending = {pool.submit(_copy_file, source / s["name"], target / s["name"], s, progress, stop) for s in todo}
        try:
            while pending:
                done, pending = wait(pending, timeout=PROGRESS_EVERY_S, return_when=FIRST_EXCEPTION)
                if any(future.exception() for future in done):
                    stop.set()
                    raise _first_error(done | wait(pending).done)  # the others end at their next chunk
                if pending:
                    log.info("%s", progress.line())
        except BaseException:
            stop.set()
            pool.shutdown(cancel_futures=True)
            raise


class _Stopped(Exception):
    """Another copy failed: this one ends early."""


def _first_error(futures) -> BaseException:
    """The error that stopped the copy, not a copy it stopped (which may have finished first)."""
    errors = [f.exception() for f in futures if f.exception() is not None]
    return next((e for e in errors if not isinstance(e, _Stopped)), errors[0])


def _copy_file(src: Path, dst: Path, expected: dict[str, Any] | None, progress: _Progress,
               stop: threading.Event) -> None:
    """src -> dst through a temporary name, hashed on the way; renamed into place only once it matches."""
    part = dst.with_name(f".{dst.name}{PART}")
    digest = hashlib.sha256()
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        with open(src, "rb") as fin, open(part, "wb") as fout:
            while chunk := fin.read(CHUNK):
                if stop.is_set():
                    raise _Stopped
                digest.update(chunk)
                fout.write(chunk)
                progress.add(len(chunk))
            fout.flush()
            os.fsync(fout.fileno())
        if expected is not None:
            _verify(src, part.stat().st_size, digest.hexdigest(), expected)
        os.replace(part, dst)
    except OSError as err:
        stop.set()  # here, not when the reporting thread wakes: a free copier would otherwise start the next shard
        part.unlink(missing_ok=True)
        raise _copy_error(src, dst, err) from None
    except BaseException as err:
        if not isinstance(err, _Stopped):
            stop.set()
        part.unlink(missing_ok=True)
        raise


def _verify(src: Path, size: int, sha256: str, expected: dict[str, Any]) -> None:
    if size != expected["bytes"]:
        raise UserError(f"shard {src} has {size} bytes, the manifest says {expected['bytes']}: it is truncated or was "
                        "rewritten after indexing", "copy it again, or re-create / re-index the shard set.")
    if expected.get("sha256", sha256) != sha256:  # sets indexed by an older writer may lack it: size only
        raise UserError(f"shard {src} does not match the SHA-256 in its manifest: it is corrupt or was rewritten "
                        "after indexing", "copy it again, or re-create / re-index the shard set.")


def _copy_error(src: Path, dst: Path, err: OSError) -> UserError:
    if err.errno == errno.ENOSPC:
        return UserError(f"the disk of data.stage_dir filled up while staging {src} to {dst.parent} on "
                         f"{socket.gethostname()}", "something else is filling that disk: point data.stage_dir at "
                         "a larger node-local disk, or leave it empty to read the shards where they are.")
    return UserError(f"cannot stage {src} to {dst.parent}: {err.strerror}",
                     "check that the shard set is complete and readable on this node, and data.stage_dir writable.")


class _Progress:
    """Bytes copied by all threads, as a log line: how much, how fast, how long still."""

    def __init__(self, source: Path, total: int) -> None:
        self.source = source
        self.total = total
        self.done = 0
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n

    def line(self) -> str:
        rate = self.done / max(time.monotonic() - self.started, 1e-3)
        left = f"about {(self.total - self.done) / rate:.0f} s left" if rate else "starting"
        return (f"staging {self.source}: {format_size(self.done)} of {format_size(self.total)} "
                f"({100 * self.done / max(self.total, 1):.0f}%), {format_size(rate)}/s, {left}")
