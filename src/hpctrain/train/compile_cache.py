"""torch.compile's caches carried across requeues, in the run directory.

Inductor keeps what it compiled (FX graphs, AOTAutograd graphs, Triton kernels, the CPU's shared objects) in
TORCHINDUCTOR_CACHE_DIR, by default a node-local temporary folder: a requeued job that lands on another node
compiles again (80 s for the DDPM U-Net on an H100). hpctrain points that folder at a node-local one of its own per
rank, and rank 0 packs it into one file beside the checkpoints after each checkpoint (only when it has grown), which
every rank unpacks before its first compiled step. One file, not thousands: what a shared file system wants.

Why not torch's mega-cache (torch.compiler.save_cache_artifacts): measured here (DDPM U-Net, CPU, torch 2.14), a
process that loaded it still spent 52 s of a 92 s cold compile, rebuilding the shared objects it does not hold; with
the cache folder itself, 3 s. The folder's entries are keyed by Inductor on torch, device and code, and the file's
name carries torch, Triton and the device model: a file for another is left alone, with a message. Dynamo still
traces again in a new process, and a graphed step is captured again (seconds).
"""

from __future__ import annotations

import io
import logging
import os
import re
import tarfile
import tempfile
from pathlib import Path

import torch

from hpctrain.atomic import atomic_write_bytes

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
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{_cpu_model()}"
    text = f"torch-{torch.__version__}_triton-{triton_version}_{name}"
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.machine()


def user_cache_dir() -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR is the user's: Inductor writes its default into the environment itself the
    first time it asks (torch 2.11 to 2.14), so a value equal to that default is not a choice of the user's."""
    value = os.environ.get(ENV)
    if not value:
        return False
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # a torch without it: whatever is set is taken as chosen
        return True
    return os.path.abspath(value) != os.path.abspath(default_cache_dir())


def local_folder(key: str, local_rank: int) -> Path:
    """This rank's own cache folder on this node (one per rank: unpacking into a folder another rank reads from
    would hand it half-written files)."""
    return Path(tempfile.gettempdir()) / f"hpctrain-inductor-{os.getuid()}" / key / f"rank{local_rank}"


class CompileCache:
    """The run's packed compile cache for this rank's device: load() before compiling, save() after (rank 0)."""

    def __init__(self, run_dir: Path, device: torch.device, is_main: bool, local_rank: int = 0) -> None:
        key = cache_key(device)
        self.folder = Path(run_dir) / FOLDER
        self.path = self.folder / f"{key}.tar"
        self.is_main = is_main
        self.local = local_folder(key, local_rank)
        self.saved_size = -1
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
                tar.extractall(self.local, filter="data")
        except (OSError, tarfile.TarError) as e:  # damaged or unreadable: compile instead of failing the run
            if self.is_main:
                log.warning("compile cache %s could not be unpacked (%s); compiling afresh", self.path, e)
            return False
        self.saved_size = _size(self.local)
        if self.is_main:
            log.info("compile cache: unpacked %s (%.1f MB) into %s", self.path, self.path.stat().st_size / 1e6,
                     self.local)
        return True

    def save(self) -> None:
        """Rank 0: pack this rank's folder into the run's file, when it grew since the last time."""
        if not (self.is_main and self.managed and self.local.is_dir()):
            return
        size = _size(self.local)
        if size <= self.saved_size:
            return
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for path in sorted(self.local.rglob("*")):
                if path.is_file() and not path.name.endswith(".lock"):
                    tar.add(path, arcname=str(path.relative_to(self.local)))
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path, buffer.getvalue())
        self.saved_size = size
        log.info("compile cache: packed %s (%.1f MB)", self.path, len(buffer.getvalue()) / 1e6)


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
