"""A slow read-only passthrough file system (FUSE): a local directory that behaves like a busy parallel file system.

    python tools/slowfs.py SOURCE MOUNTPOINT [--meta-ms 0.5] [--read-ms 0] [--mb-per-s 1000]

mounts SOURCE at MOUNTPOINT in the foreground until Ctrl-C. From Python, ``with mounted(source, mountpoint,
Slowness(...)):`` runs it in a child process for the block and unmounts it afterwards, also when the block raises.

What it models (typical of Lustre or GPFS under load, e.g. 0.5 ms a metadata operation and 1 GB/s):
- every metadata operation (open, opendir, readdir, access, statfs, and getattr, which is also the high-level
  API's lookup) sleeps ``meta_ms``: a round trip to a metadata server. The kernel's entry cache is switched off
  (timeout 0), so every stat and every open by name reaches this file system and pays it; the attributes a lookup
  returns are trusted for a second (fstat after open, reads), and lookups of directories are free: a Lustre
  client holds locks on both. So a stat costs one operation, and an open-and-read of a small file two (the file's
  lookup and the open), about what Lustre pays in RPCs (open and close, or a size glimpse).
- every read request sleeps ``read_ms`` (an object-server round trip), then waits for its share of the bandwidth
  cap: one token bucket (no burst) shared by all readers, so B bytes take at least B / ``bytes_per_s``.
  The kernel splits reads into requests of at most 128 KiB (FUSE's default max_pages), so ``read_ms`` is a cost
  per 128 KiB of sequential reading, and per file for files smaller than that.
- requests run in libfuse's multithreaded loop: one slow request does not hold up the others. Their Python
  parts hold the GIL, though, so the server uses about one core at most (0.75-1 ms of CPU per small file on the
  project's 2-core VM, which caps a per-file loader near 1,000 files/s however many readers).
What it does not model: the kernel page cache is kept across opens (as a Lustre client's is), so eviction is the
reader's business (``posix_fadvise(DONTNEED)`` on the mounted files works, and so does dropping the inodes,
``drop_caches=2``, which takes their pages with them); the data itself comes from the local
disk underneath, whose own time adds to the modelled one; no contention with other clients beyond the shared cap;
Python's own cost per request (measure it with all three settings at 0).

Counters (metadata operations that paid the latency, opens, read requests, bytes, and this process's CPU and
disk reads) are readable as JSON from the hidden file ``MOUNTPOINT/.slowfs-stats`` (not listed in its directory).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import os
import re
import resource
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

STATS = "/.slowfs-stats"
STATS_FH = 2**63  # no real descriptor; libfuse keeps handles as unsigned 64-bit


@dataclass(frozen=True, kw_only=True)
class Slowness:
    meta_ms: float = 0.5
    """Sleep of every metadata operation that reaches the server (a file's lookup, open, opendir, readdir, access,
    statfs); directory lookups and attributes returned less than a second ago are free (see the module docstring)."""
    read_ms: float = 0.0
    """Sleep of every read request (at most 128 KiB each)."""
    bytes_per_s: float = 0.0
    """Bandwidth cap shared by all reads; 0: none."""

    def args(self) -> list[str]:
        return ["--meta-ms", str(self.meta_ms), "--read-ms", str(self.read_ms),
                "--mb-per-s", str(self.bytes_per_s / 1e6)]


class Bandwidth:
    """A token bucket without burst: each request books the next free slot of the shared pipe and sleeps until its
    bytes have passed it, so concurrent readers share the cap instead of each getting it."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.bytes_per_s <= 0:
            return
        with self.lock:
            self.free_at = max(self.free_at, time.monotonic()) + n / self.bytes_per_s
            done = self.free_at
        time.sleep(max(0.0, done - time.monotonic()))


def _fuse():
    """mfusepy, imported late: without libfuse its import raises, and the benchmarks must still run locally. libfuse
    3 explicitly: mfusepy tries libfuse 2 first where both are installed, and 2 has no init_with_config (the entry
    cache would stay on) nor max_threads."""
    os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")
    import mfusepy

    if getattr(mfusepy, "fuse_version_major", 3) != 3:
        raise ImportError(f"mfusepy loaded libfuse {mfusepy.fuse_version_major}, slowfs needs libfuse 3")
    return mfusepy


def build_operations(source: Path, slowness: Slowness):
    fuse = _fuse()

    class SlowPassthrough(fuse.Operations):
        use_ns = True

        def __init__(self) -> None:
            self.bandwidth = Bandwidth(slowness.bytes_per_s)
            self.counts = {"meta_ops": 0, "opens": 0, "read_requests": 0, "read_bytes": 0}
            self.count_lock = threading.Lock()

        def _count(self, key: str, n: int = 1) -> None:
            with self.count_lock:
                self.counts[key] += n

        def _meta(self, path: str) -> str:
            self._count("meta_ops")
            time.sleep(slowness.meta_ms / 1000)
            return str(source) + path

        def init_with_config(self, conn_info, config) -> None:
            if config is not None:
                # Every path lookup (so every stat and open by name) reaches us. The attributes it returns are
                # then trusted for a second, so fstat on the open file and the reads that follow do not come back
                # (with timeout 0, each read syscall would also ask for them: three more operations per file).
                config.entry_timeout = config.negative_timeout = 0.0
                config.attr_timeout = 1.0
                config.kernel_cache = 1  # the page cache stays across opens, as a Lustre client's does

        def getattr(self, path: str, fh=None) -> dict:
            if path == STATS:
                return {"st_mode": 0o100444, "st_nlink": 1, "st_size": 4096}
            st = _call(os.lstat, str(source) + path)
            if not stat.S_ISDIR(st.st_mode):  # directories: free, see the module's docstring
                self._meta(path)
            return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_ino",
                                                "st_atime_ns", "st_mtime_ns", "st_ctime_ns")}

        def access(self, path: str, amode: int) -> int:
            if not os.access(self._meta(path), amode):
                raise fuse.FuseOSError(errno.EACCES)
            return 0

        def statfs(self, path: str) -> dict:
            sv = os.statvfs(self._meta(path))
            return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                                "f_files", "f_flag", "f_frsize", "f_namemax")}

        def opendir(self, path: str) -> int:
            self._meta(path)
            return 0

        def readdir(self, path: str, fh: int):
            return [".", "..", *_call(os.listdir, self._meta(path))]

        def open(self, path: str, flags: int) -> int:
            if flags & (os.O_WRONLY | os.O_RDWR):
                raise fuse.FuseOSError(errno.EROFS)
            if path == STATS:
                return STATS_FH
            self._count("opens")
            return _call(os.open, self._meta(path), os.O_RDONLY)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            if fh == STATS_FH:
                return self._stats()[offset:offset + size]
            time.sleep(slowness.read_ms / 1000)
            data = os.pread(fh, size, offset)
            self.bandwidth.take(len(data))
            self._count("read_requests")
            self._count("read_bytes", len(data))
            return data

        def release(self, path: str, fh: int) -> int:
            if fh != STATS_FH:
                os.close(fh)
            return 0

        def _stats(self) -> bytes:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            with self.count_lock:
                counts = dict(self.counts)
            counts |= {"cpu_s": usage.ru_utime + usage.ru_stime, "disk_bytes": usage.ru_inblock * 512}
            return json.dumps(counts).encode().ljust(4096)

    return SlowPassthrough()


def _call(fn, *args):
    """A source-side OSError becomes the FUSE error the caller sees (ENOENT for a missing file, and so on)."""
    try:
        return fn(*args)
    except OSError as e:
        raise _fuse().FuseOSError(e.errno) from None


def serve(source: Path, mountpoint: Path, slowness: Slowness) -> None:
    """Mount and serve in the foreground until unmounted or interrupted (libfuse unmounts on SIGINT/SIGTERM)."""
    fuse = _fuse()
    fuse.FUSE(build_operations(source.resolve(), slowness), str(mountpoint), foreground=True, ro=True,
              fsname=f"slowfs:{source}", max_threads=64)


def read_stats(mountpoint: Path) -> dict:
    with open(mountpoint / STATS.lstrip("/"), "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the kernel keeps pages across opens
        return json.loads(f.read())


def unavailable() -> str | None:
    """Why no FUSE file system can be mounted here, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (load the fuse module, or give the container --device /dev/fuse)"
    if os.geteuid() != 0:
        return "mounting FUSE here needs root"
    if not shutil.which("fusermount3"):
        return "no fusermount3 (as root: make fuse-deps, or apt-get install fuse3)"
    try:
        _fuse()
    except (ImportError, OSError) as e:
        return f"mfusepy cannot load libfuse ({e}); pip install mfusepy, apt-get install fuse3"
    return _trial_mount()


@functools.lru_cache(maxsize=1)
def _trial_mount() -> str | None:
    """Mount an empty folder once: a container without CAP_SYS_ADMIN, AppArmor or an old libfuse pass the checks
    above and fail only here; then the tests skip with the reason instead of failing."""
    with tempfile.TemporaryDirectory(prefix="slowfs-trial-") as folder:
        (Path(folder) / "src").mkdir()
        try:
            with mounted(Path(folder) / "src", Path(folder) / "mnt", Slowness(meta_ms=0, bytes_per_s=0), timeout_s=15):
                return None
        except RuntimeError as e:
            return f"a trial mount failed: {str(e).strip().splitlines()[-2:]}"


@contextlib.contextmanager
def mounted(source: Path, mountpoint: Path, slowness: Slowness, timeout_s: float = 20.0) -> Iterator[Path]:
    """``source`` served slowly at ``mountpoint`` by a child process for the block; unmounted after it, and the
    child ended, also when the block raises. The child dies with us (PR_SET_PDEATHSIG, set in the child's main:
    not between fork and exec, where loading libc could deadlock on a lock another thread of ours held), so even
    a killed benchmark leaves no server behind (the mount then reads ENOTCONN until ``fusermount3 -u``)."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as stderr:
        cmd = [sys.executable, __file__, str(source), str(mountpoint), *slowness.args(), "--parent", str(os.getpid())]
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            _wait_for_mount(mountpoint, child, stderr, timeout_s)
            yield mountpoint
        finally:
            _unmount(mountpoint, child)


def is_mounted(mountpoint: Path) -> bool:
    """From the mount table, not os.path.ismount: the mount of a crashed server fails every stat (ENOTCONN)."""
    target = os.path.realpath(mountpoint)
    with open("/proc/self/mounts") as table:  # spaces and the like come octal-escaped: \040
        return any(_unescape(line.split()[1]) == target for line in table)


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _wait_for_mount(mountpoint: Path, child: subprocess.Popen, stderr, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_mounted(mountpoint):
        if child.poll() is not None or time.monotonic() > deadline:
            stderr.seek(0)
            state = (f"exited with {child.returncode}" if child.returncode is not None
                     else f"not mounted after {timeout_s} s")
            raise RuntimeError(f"slowfs at {mountpoint} {state}; its stderr:\n{stderr.read().decode()[-3000:]}\n"
                               f"HINT: check that `python {__file__} SOURCE MOUNTPOINT` works by hand.")
        time.sleep(0.05)


def _unmount(mountpoint: Path, child: subprocess.Popen) -> None:
    if is_mounted(mountpoint):
        done = _fusermount("-u", mountpoint)
        if done != 0:  # busy (a reader still has a file open): detach it from the tree now
            _fusermount("-u", "-z", mountpoint)
            child.terminate()  # a detached server would serve the open files until they close; they then fail
    else:
        child.terminate()  # not (yet) mounted, e.g. a mount timed out: libfuse unmounts on SIGTERM if it got there
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    if is_mounted(mountpoint):  # the server is gone, its mount must not stay behind (every access: ENOTCONN)
        _fusermount("-u", "-z", mountpoint)


def _fusermount(*args) -> int:
    try:
        return subprocess.run(["fusermount3", *map(str, args)], capture_output=True, check=False, timeout=30).returncode
    except subprocess.TimeoutExpired:
        return 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path)
    p.add_argument("mountpoint", type=Path)
    p.add_argument("--meta-ms", type=float, default=0.5, help="sleep per metadata operation (default 0.5)")
    p.add_argument("--read-ms", type=float, default=0.0, help="sleep per read request of <= 128 KiB (default 0)")
    p.add_argument("--mb-per-s", type=float, default=1000.0,
                   help="bandwidth cap over all reads, 0: none (default 1000)")
    p.add_argument("--parent", type=int, default=0, help=argparse.SUPPRESS)  # mounted(): die with this process
    args = p.parse_args()
    if args.parent:
        from hpctrain.dist.parent_death import die_with_parent

        die_with_parent()
        if os.getppid() != args.parent:  # it died before the line above
            raise SystemExit(0)
    if not args.source.is_dir():
        raise SystemExit(f"{args.source} is not a directory: give the directory to serve slowly")
    serve(args.source, args.mountpoint, Slowness(meta_ms=args.meta_ms, read_ms=args.read_ms,
                                                 bytes_per_s=args.mb_per_s * 1e6))


if __name__ == "__main__":
    main()
