"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a crash after rename could otherwise lose it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process's umask, without changing it even for a moment where Linux says it (/proc/self/status; a
    set-and-restore would race other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The mode open() gives a new file under the umask (0o644 under 022): what teammates on a shared file system
    need to read a run's config, checkpoints and export."""
    return 0o666 & ~current_umask()


def give_new_file_mode(path: str | Path) -> None:
    """mkstemp (and writers built on it, such as safetensors) create files 0o600 whatever the umask; a temporary file
    renamed into place would keep that, and nobody else could resume from or use it."""
    os.chmod(path, new_file_mode())


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, new_file_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
