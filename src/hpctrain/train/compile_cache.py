"""torch.compile's caches carried across requeues, in the run directory.

Inductor keeps what it compiled (FX and AOTAutograd graphs, Triton kernels, the CPU's shared objects) in
TORCHINDUCTOR_CACHE_DIR, by default a node-local temporary folder: a requeued job on another node compiles again.
hpctrain points it at a node-local folder of its own per run, host and local rank, and rank 0 packs its node's
folders (every local rank's: Inductor keys its entries by the device index) into one file beside the checkpoints
after each checkpoint (only when they have grown); every rank unpacks its local rank's part before its first
compiled step. One file, not thousands: what a shared file system wants.

Not torch's mega-cache (torch.compiler.save_cache_artifacts): a process that loaded it still rebuilt the shared
objects it does not hold (BENCHMARKS.md). The folder's entries are keyed by Inductor on torch, device and code, and
the file's name carries torch, Triton and the device model: a file for another is left alone, with a message.
Dynamo still traces again in a new process, and a graphed step is captured again (seconds).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import socket
import tarfile
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from hpctrain.fault.run_lock import process_start
from hpctrain.provenance import cpu_model

log = logging.getLogger("hpctrain")

FOLDER = "compile-cache"
ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_key(device: torch.device) -> str:
    """torch, Triton and the device model: what a packed cache is for."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # CPU-only builds: Inductor compiles C++ there
        triton_version = "none"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{cpu_model()}"
    text = f"torch-{torch.__version__}_triton-{triton_version}_{name}"
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-")


def user_cache_dir() -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR is the user's: Inductor writes its default into the environment itself the
    first time it asks (torch 2.11 to 2.14), and hpctrain its own folder, so neither is a choice of the user's."""
    value = os.environ.get(ENV)
    if not value or Path(value).resolve().is_relative_to(_root().resolve()):  # empty, or hpctrain's own
        return False
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # a torch without it: whatever is set is taken as chosen
        return True
    return os.path.abspath(value) != os.path.abspath(default_cache_dir())


def node_folder(key: str, run_dir: Path) -> Path:
    """This run's cache folders on this node: one per run (two jobs of one user on a node do not share them) and
    host (in a $TMPDIR that nodes share, local rank 0 of two nodes would use one folder, and the first node to
    finish would remove it under the other)."""
    run = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return _root() / key / f"{run}-{_host()}"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", socket.gethostname()).strip("-.") or "host"


def _root() -> Path:
    return Path(tempfile.gettempdir()) / f"hpctrain-inductor-{os.getuid()}"


class CompileCache:
    """The run's packed compile cache for this rank's device: load() before compiling, save() after (rank 0)."""

    def __init__(self, run_dir: Path, device: torch.device, is_main: bool, local_rank: int = 0) -> None:
        key = cache_key(device)
        self.folder = Path(run_dir) / FOLDER
        self.path = self.folder / f"{key}.tar"
        self.is_main = is_main
        self.node = node_folder(key, run_dir)
        self.part = f"rank{local_rank}"
        self.local = self.node / self.part
        """This rank's own folder (one per local rank: unpacking into a folder another rank reads from would hand
        it half-written files)."""
        self.saved_size = -1
        self.broken = False
        """Set by a failed save: the cache is optional, so the run goes on without packing it again."""
        self.managed = not user_cache_dir()
        """False when the user set TORCHINDUCTOR_CACHE_DIR: theirs is used as it is, and nothing is packed."""

    def load(self) -> bool:
        """Point Inductor at this rank's folder and fill it from the run's file; False when there is none for this
        torch/Triton/device (or the user manages the cache)."""
        if not self.managed:
            if self.is_main:
                log.info("compile cache: %s=%s is set, used as it is (hpctrain does not carry it across requeues)",
                         ENV, os.environ[ENV])
            return False
        self.local.mkdir(parents=True, exist_ok=True)
        os.environ[ENV] = str(self.local)
        if not self.path.is_file():
            others = sorted(p.name for p in self.folder.glob("*.tar")) if self.folder.is_dir() else []
            if others and self.is_main:
                log.info("compile cache: none for this torch/Triton/device (%s); not used: %s (compiling afresh)",
                         self.path.name, ", ".join(others))
            return False
        try:
            with tarfile.open(self.path) as tar:
                mine = [m for m in tar.getmembers() if m.name.startswith(self.part + "/")]
                _extract(tar, mine, self.node)
        except (OSError, tarfile.TarError, ValueError) as e:  # damaged or unreadable: compile instead of failing
            if self.is_main:
                log.warning("compile cache %s could not be unpacked (%s); compiling afresh", self.path, e)
            return False
        self.saved_size = _size(self.node)
        if self.is_main:
            log.info("compile cache: unpacked %s (%.1f MB) into %s", self.path, self.path.stat().st_size / 1e6,
                     self.local)
        return True

    def save(self) -> None:
        """Rank 0: pack its node's folders (every local rank's) into the run's file, when they grew since the last
        time. Streamed to a temporary file beside it and renamed: a reader sees the old file or the new one. An I/O
        error (a full disk, a file Inductor removed meanwhile) is warned about once and ends the packing for this
        run: the cache only saves compile time, and this is called right after a good checkpoint."""
        if not (self.is_main and self.managed and not self.broken and self.node.is_dir()):
            return
        try:
            self._pack()
        except (OSError, tarfile.TarError) as err:
            self.broken = True
            log.warning("compile cache: could not pack %s (%s); training goes on without it, and a requeued launch "
                        "compiles afresh. Not tried again in this run", self.path, err)

    def _pack(self) -> None:
        size = _size(self.node)
        if size <= self.saved_size:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        try:
            with tarfile.open(tmp, mode="w") as tar:
                for path in sorted(self.node.rglob("*")):
                    if path.is_file() and not path.name.endswith(".lock") and path.name != OWNER:
                        tar.add(path, arcname=str(path.relative_to(self.node)))
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        self.saved_size = size
        log.info("compile cache: packed %s (%.1f MB)", self.path, self.path.stat().st_size / 1e6)


@contextlib.contextmanager
def node_copy_removed(run_dir: Path, device: torch.device, local_rank: int, compiled: bool) -> Iterator[None]:
    """Around a run's training: this rank's node-local folder is removed when it ends, however it ends (one folder
    per run and node would otherwise pile up in $TMPDIR: a 100-point sweep leaves 100). The run's packed file is
    what a resumed or requeued launch loads, on this node or another. Exited after the run's last barrier, which
    follows rank 0's last save: no peer's folder disappears while rank 0 packs it. A process that is killed leaves
    its folder; a later run on the node removes it (prune_dead_runs)."""
    if not compiled:
        yield
        return
    node = node_folder(cache_key(device), run_dir)
    _claim(node / f"rank{local_rank}")
    prune_dead_runs(node)
    try:
        yield
    finally:
        shutil.rmtree(node / f"rank{local_rank}", ignore_errors=True)
        for empty in (node, node.parent):  # the last rank of the node to leave removes the run's folder
            with contextlib.suppress(OSError):
                empty.rmdir()


OWNER = ".owner"
"""In each rank's node-local folder: '<pid> <start> <host>' of the process that uses it, for prune_dead_runs."""


def _claim(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / OWNER).write_text(f"{os.getpid()} {process_start(os.getpid())} {socket.gethostname()}")


def prune_dead_runs(keep: Path) -> None:
    """Remove this node's folders of runs whose processes were killed (their owner pid is gone or reused), except
    ``keep``; folders without an owner file (hpctrain before this one) are left alone."""
    for owner in _root().glob(f"*/*/rank*/{OWNER}"):
        folder = owner.parent
        if folder.parent == keep:
            continue
        try:
            pid, started, host = owner.read_text().split()
            # Alive; or another host's (a $TMPDIR shared by nodes: its pids are not ours to look up).
            if process_start(int(pid)) == started or host != socket.gethostname():
                continue
        except (OSError, ValueError):  # no /proc here (no start to write), or not our format: left alone
            continue
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            folder.parent.rmdir()


def _extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], into: Path) -> None:
    """Regular files only, inside ``into``: tarfile's "data" filter where this Python has it (3.11.4+, 3.10.12+),
    the same rules checked by hand where it does not."""
    for m in members:
        if not m.isfile() or m.name.startswith("/") or ".." in Path(m.name).parts:
            raise ValueError(f"unexpected member {m.name!r}")
    if hasattr(tarfile, "data_filter"):
        tar.extractall(into, members=members, filter="data")
    else:  # pragma: no cover - older patch releases
        tar.extractall(into, members=members)


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
