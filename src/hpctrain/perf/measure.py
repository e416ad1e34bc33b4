"""The measurements of the performance pre-flight: all-reduce bandwidth, matrix-multiply throughput,
and a straggler check. Each runs on every rank of an initialised process group (or one process).

Bandwidth follows nccl-tests' definitions (doc/PERFORMANCE.md there): for a message of S bytes
that takes t seconds, algorithm bandwidth algbw = S / t, and for all-reduce the bus bandwidth
busbw = algbw x 2(n-1)/n, which is what each link carries in a ring and so is comparable with
the hardware's link speed whatever the number of ranks n. A collective is done when its slowest
rank is done, so t is the maximum over ranks of each rank's median time.
"""

from __future__ import annotations

import os
import stat
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpctrain.dist.collectives import barrier, broadcast_object
from hpctrain.dist.runtime import Runtime
from hpctrain.errors import UserError, on_every_rank


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth (0 for one rank: nothing crosses a link)."""
    return algbw * 2 * (world_size - 1) / world_size


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """min, min x factor, ... up to max (inclusive when it lies on the sequence), float32-aligned."""
    sizes, size = [], max(4, min_bytes - min_bytes % 4)
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


@dataclass(frozen=True)
class BandwidthRow:
    bytes: int
    """Message size."""
    time_us: float
    """Slowest rank's median time per all-reduce."""
    algbw_gbps: float
    """bytes / time, GB/s."""
    busbw_gbps: float
    """algbw x 2(n-1)/n, GB/s."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, runtime: Runtime) -> float:
    if not runtime.distributed:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_reduce_bandwidth(runtime: Runtime, sizes: list[int], iters: int = 20, warmup: int = 3) -> list[BandwidthRow]:
    """Sum all-reduce of float32 tensors of each size; fewer timed iterations for large messages."""
    rows = []
    for size in sizes:
        buf = torch.ones(size // 4, dtype=torch.float32, device=runtime.device)
        n = iters if size <= 1 << 20 else max(3, iters // 4)
        times = []
        for i in range(warmup + n):
            if runtime.distributed:
                dist.barrier()
            _sync(runtime.device)
            start = time.perf_counter()
            if runtime.distributed:
                dist.all_reduce(buf)
            _sync(runtime.device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        t = _slowest(statistics.median(times), runtime)
        algbw = size / t / 1e9 if t > 0 else 0.0
        rows.append(BandwidthRow(size, t * 1e6, algbw, bus_bandwidth(algbw, runtime.world_size)))
        del buf
    return rows


def matmul_tflops(device: torch.device, n: int, dtype: torch.dtype, iters: int = 10) -> float:
    """Dense n x n x n matrix multiplies per second, in TFLOP/s (2 n^3 per multiply)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up: kernels chosen, caches filled
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


@dataclass(frozen=True)
class Straggler:
    times_s: list[float]
    """Each rank's time for the same fixed compute step (index = rank)."""
    slowest_rank: int
    ratio: float
    """Slowest rank's time / median rank's time."""


def straggler_check(runtime: Runtime, n: int, dtype: torch.dtype, iters: int = 5) -> Straggler:
    """Every rank times the same fixed work; a rank much slower than the median slows every step of DDP."""
    a = torch.randn(n, n, device=runtime.device, dtype=dtype)
    a @ a
    if runtime.distributed:
        dist.barrier()
    _sync(runtime.device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ a
    _sync(runtime.device)
    mine = time.perf_counter() - start
    times = [mine]
    if runtime.distributed:
        out = torch.zeros(runtime.world_size, dtype=torch.float64, device=runtime.device)
        out[runtime.rank] = mine
        dist.all_reduce(out)
        times = out.tolist()
    slowest = max(range(len(times)), key=times.__getitem__)
    return Straggler(times, slowest, times[slowest] / statistics.median(times))


@dataclass(frozen=True)
class DataProbe:
    """What one rank got from the data's file system, all ranks reading at once."""

    files: int
    """This rank's share of the files under the data path (every world_size-th)."""
    mean_file_bytes: float
    """Mean size of this rank's files."""
    opens_per_s: float
    """open + fstat + close of this rank's files (the metadata cost a file-per-sample loader pays)."""
    read_mbps: float
    """Sequential reads in 1 MiB blocks of this rank's files, page cache dropped first (MB/s)."""
    bytes_read: int


def list_files(root: str) -> list[str]:
    """Paths (relative to root, sorted) of what lies under root and is not a directory, without a stat per
    file: os.scandir's entries carry each name's type from the directory read itself (d_type), so listing
    1M files costs the directory reads, not 1M metadata operations. Symbolic links are listed unresolved
    (whoever opens one resolves it); on a file system that reports no d_type, os.scandir falls back to an
    lstat per entry, which no listing can avoid there."""
    found, todo = [], [""]
    while todo:
        rel = todo.pop()
        try:
            entries = os.scandir(os.path.join(root, rel) if rel else root)
        except PermissionError:
            if not rel:
                raise
            continue  # an unreadable subdirectory: skipped, as Path.rglob does
        with entries:
            for entry in entries:
                name = os.path.join(rel, entry.name) if rel else entry.name
                if entry.is_dir(follow_symlinks=False):  # Path.rglob does not descend into linked directories either
                    todo.append(name)
                else:
                    found.append(name)
    return sorted(found)


def my_files(runtime: Runtime, root: str) -> list[tuple[str, int]]:
    """This rank's share of the files under root (every world_size-th of rank 0's listing) with their sizes.
    Rank 0 alone lists the tree (no stat per file) and broadcasts the names; each rank stats only its own
    share. Listing on every rank, or a stat of every file, would make N ranks x M files metadata operations:
    the storm this probe exists to detect. A name that no longer is a regular file (a link to a directory,
    a file deleted since the listing) is dropped by the rank that owns it."""
    listing: tuple[list[str], str] = ([], "")
    if runtime.is_main:
        try:
            listing = (list_files(root), "")
        except OSError as err:  # every rank must hear it, not wait for a list that never comes
            listing = ([], f"cannot list --data {root}: {err.strerror or err}")
    names, error = broadcast_object(listing, runtime)
    if error:
        raise on_every_rank(UserError(error, "give a readable directory to --data (the data run dirs read)."))
    mine = []
    for name in names[runtime.rank::runtime.world_size]:
        path = os.path.join(root, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            mine.append((path, st.st_size))
    return mine


def data_read_probe(runtime: Runtime, root: str, max_bytes: int, max_opens: int = 2000) -> DataProbe:
    """Every rank reads its own files (every world_size-th) at the same time, as loaders do. Cached pages
    are dropped with posix_fadvise first (no root needed for clean pages), so repeated probes measure the
    file system, not memory; a file system that ignores the advice (some network ones) reads warm."""
    files = my_files(runtime, root)
    total = sum(size for _, size in files)
    barrier(runtime)
    start = time.perf_counter()
    # A file this rank cannot open (another user's mode 0600, deleted since the listing) is skipped, not raised:
    # raised on one rank alone, the others would wait for it at the next collective.
    for path, _ in files[:max_opens]:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        os.fstat(fd)
        os.close(fd)
    opens = min(len(files), max_opens) / max(time.perf_counter() - start, 1e-9)
    read, start = 0, time.perf_counter()
    for path, _ in files:
        if read >= max_bytes:
            break
        try:
            read += _read_cold(path, max_bytes - read)
        except OSError:
            continue
    seconds = max(time.perf_counter() - start, 1e-9)
    return DataProbe(len(files), total / max(len(files), 1), opens, read / seconds / 1e6, read)


def _read_cold(path: str, limit: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        done = 0
        while done < limit:
            block = os.read(fd, min(1 << 20, limit - done))
            if not block:
                break
            done += len(block)
        return done
    finally:
        os.close(fd)
