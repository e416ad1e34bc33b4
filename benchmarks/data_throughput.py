"""Loader throughput: one JPEG file per sample vs hpctrain shards vs the webdataset library. Prints a table.

    python benchmarks/data_throughput.py [--images 50000] [--workers 2] [--repeats 3] [--workdir DIR]
                                         [--fs local,fuse,slow] [--readers 1,2,4] [--slow-meta-ms 0.5] ...

Method
- A generated ImageFolder set of ``--images`` small JPEGs (64x64, 10 classes, ~2-3 KB each) is
  packed with ``hpctrain shard --format imagefolder`` (32 MB shards). Kept in --workdir between runs.
- Each pipeline reads one shuffled epoch with the same DataLoader settings (``--workers`` fork
  workers, batch ``--batch``), and the same decode (torchvision ``decode_jpeg`` of the bytes) and label:
  (a) per-file: a map-style dataset that opens and reads one file per sample, random order;
  (b) hpctrain: ``ShardDataset`` + the step sampler's windowed shard order + ``build_loader``;
  (c) webdataset: ``WebDataset(shards, shardshuffle) .shuffle(4096) .map(decode) .batched()``.
- Cold cache: before every timed pass every data file (JPEGs and shards) is evicted from the page
  cache with ``posix_fadvise(DONTNEED)``, and as root the dentry and inode caches are dropped
  (``drop_caches=2``). Not the whole page cache: that also evicts Python, torch and their libraries,
  whose re-reading would dominate time and bytes. Passes are interleaved (a, b, c, a, b, c, ...); medians over
  ``--repeats``.
- Each pass runs in a fresh process; imports and loader construction are not timed. CPU time (user +
  system of the process and its workers) and bytes read from the block device come from ``getrusage``
  (self + reaped children) around the epoch, the workers being joined before the second reading. Files opened
  come from one extra ``strace -f -e trace=openat`` pass per pipeline (not timed), when strace exists.
- ``--fs``: where the passes read. ``local``: the work directory. ``slow``: the same files through
  tools/slowfs.py, a FUSE passthrough adding ``--slow-meta-ms`` to every metadata operation and
  ``--slow-read-ms`` to every read request, under a ``--slow-mb-per-s`` cap shared by all readers (a busy
  parallel file system). ``fuse``: the same passthrough with no latency and no cap, which shows what the
  Python FUSE server itself costs. Its counters give the files opened, metadata operations, MB served and the
  server's CPU of each pass. Cold there too: dropping the inodes (root) drops the mount's pages with them.
- ``--readers N``: N reader processes start together (after their loaders are built) and each reads a disjoint
  1/N of the epoch, as the N ranks of a node do (per-file: every N-th sample of the shuffled order; hpctrain: its
  rank's part of each global batch of N x ``--batch``; webdataset: every N-th shard). samples/s is the aggregate:
  all samples over the time from the first reader's start to the last one's end.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

PASS_TIMEOUT_S = 3600  # one pass of one reader; a hung reader fails the benchmark, not the CI job
PIPELINES = ("per-file", "hpctrain", "webdataset")
FILE_SYSTEMS = ("local", "fuse", "slow")
SIZE = 64


def prepare(workdir: Path, images: int) -> tuple[Path, Path]:
    import numpy as np
    from PIL import Image

    from hpctrain.datasets.fixtures import pattern_image
    from hpctrain.datasets.shard_writer import ShardRequest, write_shards as shard_command

    files, shards = workdir / "files", workdir / "shards"
    marker = workdir / f"ready_{images}"
    if marker.exists():
        return files, shards / "train"
    shutil.rmtree(workdir, ignore_errors=True)
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    for i in range(images):
        folder = files / f"class_{i % 10}"
        if i < 10:
            folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pattern_image(rng, i % 10, SIZE)).save(folder / f"{i:07d}.jpg", quality=90)
    print(f"generated {images} JPEGs in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    shard_command(ShardRequest(files, shards, "imagefolder", 32 * 10**6))
    marker.write_text("")
    return files, shards / "train"


# ---------------------------------------------------------------- one pass (in a fresh process)


def _decode(data: bytes):
    import torch

    from hpctrain.data.image_decode import decode_image

    return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), "UNCHANGED")


class PerFile:
    """ImageFolder's access pattern: open, read, close one file per sample."""

    def __init__(self, root: Path) -> None:
        self.items = [(p, int(p.parent.name.split("_")[1])) for p in sorted(root.glob("class_*/*.jpg"))]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        path, label = self.items[i]
        with open(path, "rb") as f:
            return _decode(f.read()), label


def _wds_sample(sample: dict):
    return _decode(sample["jpg"]), int(sample["cls"])


def loader(name: str, files: Path, shards: Path, workers: int, batch: int, rank: int = 0, readers: int = 1):
    """The pipeline's loader over reader ``rank``'s 1/``readers`` of the epoch."""
    import torch
    from torch.utils.data import DataLoader

    common = {"num_workers": workers, "multiprocessing_context": "fork" if workers else None}
    if name == "per-file":
        ds = PerFile(files)
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))[rank::readers].tolist()
        return DataLoader(ds, batch_size=batch, sampler=order, **common)
    if name == "hpctrain":
        from hpctrain.config.batch import batch_sizes
        from hpctrain.config.schema import DataSection
        from hpctrain.data.loader import build_loader
        from hpctrain.data.sampler import StepBatchSampler
        from hpctrain.data.shardset import ShardDataset
        from hpctrain.dist.runtime import Runtime

        ds = ShardDataset(shards, ["jpg", "cls"])  # decodes with torchvision too
        plan = batch_sizes(batch * readers, batch, readers)
        sampler = StepBatchSampler(len(ds), plan, rank, seed=0, order=ds.epoch_order)
        runtime = Runtime(launcher="single", rank=rank, local_rank=rank, world_size=readers,
                          local_world_size=readers, node_rank=0,
                          num_nodes=1, master_addr="", master_port=0, hostname="bench", job_id="",
                          device=torch.device("cpu"), backend="")
        cfg = DataSection(num_workers=workers, worker_start="fork", persistent_workers=False)
        return build_loader(ds, sampler, cfg, runtime, seed=0)
    import webdataset as wds

    urls = sorted(str(p) for p in shards.glob("*.tar"))
    pipeline = wds.WebDataset(urls, shardshuffle=len(urls), seed=0, empty_check=False,
                              nodesplitter=lambda shards: list(shards)[rank::readers])
    pipeline = pipeline.shuffle(4096).map(_wds_sample)
    return DataLoader(pipeline.batched(batch), batch_size=None, **common)


def one_pass(args: argparse.Namespace) -> None:
    files, shards = Path(args.files), Path(args.shards)
    # Imports (torchvision's decoders load lazily) and loader construction are not what is measured.
    _decode(next(files.glob("class_0/*.jpg")).read_bytes())
    batches = loader(args.run, files, shards, args.workers, args.batch, args.rank, args.readers)
    print("ready", flush=True)
    if sys.stdin.readline() != "go\n":  # the driver's go: all readers start together, as a node's ranks at their
        raise SystemExit(1)               # first step; end of input instead: the driver failed, read nothing
    before = _usage()
    started = time.time()  # wall clock: the driver compares the readers' start and end times
    count, images = 0, None  # a reader whose share is empty (fewer shards than readers) gets no batch
    for images, _labels in batches:
        count += len(images)
    ended = time.time()
    del batches, images
    gc.collect()  # the loaders' workers are joined (reaped) here, so their usage is counted below
    after = _usage()
    print(json.dumps({"samples": count, "start": started, "end": ended, "cpu_s": after[0] - before[0],
                      "read_bytes": (after[1] - before[1]) * 512}))


def _usage() -> tuple[float, int]:
    """CPU seconds and blocks read of this process and its reaped children (the loader workers)."""
    cpu, blocks = 0.0, 0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        u = resource.getrusage(who)
        cpu += u.ru_utime + u.ru_stime
        blocks += u.ru_inblock
    return cpu, blocks


# ---------------------------------------------------------------- the driver


@dataclass(frozen=True)
class Tree:
    """Where a pass reads: the work directory itself, or the same files through a FUSE mount of it."""

    fs: str
    files: Path
    shards: Path
    counters: Callable[[], dict]
    """The FUSE server's counters (slowfs.read_stats); {} on the local disk."""


@contextlib.contextmanager
def trees(args: argparse.Namespace, files: Path, shards: Path) -> Iterator[list[Tree]]:
    """One Tree per --fs, the FUSE ones mounted for the whole run (and unmounted however it ends)."""
    workdir = Path(args.workdir).resolve()
    with contextlib.ExitStack() as stack:
        found = []
        for fs in args.fs:
            if fs == "local":
                found.append(Tree(fs, files, shards, dict))
                continue
            slowfs = _slowfs()
            if reason := slowfs.unavailable():
                raise SystemExit(f"--fs {fs} cannot mount here: {reason}. HINT: leave it out, or run as root.")
            slowness = (slowfs.Slowness(meta_ms=0, read_ms=0, bytes_per_s=0) if fs == "fuse" else
                        slowfs.Slowness(meta_ms=args.slow_meta_ms, read_ms=args.slow_read_ms,
                                        bytes_per_s=args.slow_mb_per_s * 1e6))
            mount = Path(tempfile.mkdtemp(prefix=f"hpctrain-bench-{fs}-"))
            stack.callback(_remove_empty, mount)  # never rmtree: that would walk a mount that failed to go
            stack.enter_context(slowfs.mounted(workdir, mount, slowness))
            found.append(Tree(fs, mount / files.relative_to(workdir), mount / shards.relative_to(workdir),
                              lambda mount=mount: slowfs.read_stats(mount)))
        yield found


def _remove_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):
        folder.rmdir()


@functools.lru_cache(maxsize=1)
def _slowfs():
    """tools/slowfs.py (tools/ is no package), loaded by path: not by putting tools/ on sys.path, where its
    modules would shadow modules of those names for the rest of the process."""
    spec = importlib.util.spec_from_file_location("slowfs", Path(__file__).resolve().parents[1] / "tools" / "slowfs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["slowfs"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def drop_caches(paths: list[Path]) -> str:
    """Evict the data files (only them) from the page cache, then, where allowed (root), the dentry and
    inode caches, so that opening a file costs its metadata lookups again. Not the whole page cache
    (drop_caches=1): that also evicts Python, torch and their libraries, whose re-reading would then
    dominate both the time and the bytes read. The FUSE mounts' pages go with their inodes (and the
    servers' counters of bytes served show that they did)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("2\n")
        return "cold: data pages evicted (posix_fadvise), dentries and inodes dropped (drop_caches=2)"
    except OSError:
        return "cold: data pages evicted (posix_fadvise); dentry/inode caches kept (not root)"


def reader_command(name: str, args: argparse.Namespace, tree: Tree, rank: int, readers: int) -> list[str]:
    return [sys.executable, __file__, "--run", name, "--files", str(tree.files), "--shards", str(tree.shards),
            "--workers", str(args.workers), "--batch", str(args.batch), "--rank", str(rank), "--readers", str(readers)]


def timed(name: str, args: argparse.Namespace, tree: Tree, readers: int, all_files: list[Path]) -> dict:
    """One cold pass of ``readers`` processes started together; their sums, and the FUSE server's counters."""
    method = drop_caches(all_files) if args.cold else "warm"
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(readers)]
        procs = [stack.enter_context(subprocess.Popen(reader_command(name, args, tree, rank, readers), text=True,
                                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log))
                 for rank, log in enumerate(logs)]
        for proc, log in zip(procs, logs):
            if proc.stdout.readline().strip() != "ready":
                _fail(name, procs, log)
        before = tree.counters()
        try:
            for proc in procs:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            outs = [proc.communicate(timeout=PASS_TIMEOUT_S)[0] for proc in procs]
        except BaseException:
            for proc in procs:  # no reader outlives a failed pass (Popen's exit would wait for it without a limit)
                proc.kill()
            raise
        after = tree.counters()
        for proc, log in zip(procs, logs):
            if proc.returncode != 0:
                _fail(name, procs, log)
    runs = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    server = {k: after[k] - before[k] for k in after}
    return {"samples": sum(r["samples"] for r in runs),
            "seconds": max(r["end"] for r in runs) - min(r["start"] for r in runs),
            "cpu_s": sum(r["cpu_s"] for r in runs),
            "read_bytes": sum(r["read_bytes"] for r in runs) + server.get("disk_bytes", 0),
            "server": server, "cache": method}


def _fail(name: str, procs: list[subprocess.Popen], log) -> None:
    for proc in procs:
        proc.kill()
    log.seek(0)
    raise SystemExit(f"{name} failed:\n{log.read()[-3000:]}")


def files_opened(name: str, args: argparse.Namespace, tree: Tree) -> int | None:
    if not shutil.which("strace"):
        return None
    log = Path(args.workdir) / f"strace_{name}.log"
    cmd = ["strace", "-f", "-qq", "-e", "trace=openat", "-o", str(log), *reader_command(name, args, tree, 0, 1)]
    subprocess.run(cmd, input="go\n", capture_output=True, text=True, check=True)
    root = str(Path(args.workdir).resolve())
    count = sum(1 for line in log.read_text().splitlines()
                if root in line and "ENOENT" not in line and "O_DIRECTORY" not in line)
    log.unlink()
    return count


def median(runs: list[dict], value: Callable[[dict], float]) -> float:
    return statistics.median(value(r) for r in runs)


HEADER = ("| fs | readers | pipeline | samples/s | range | vs per-file | s per epoch | CPU ms/sample "
          "| FUSE server CPU ms/sample | MB read from disk | MB served by FUSE | files opened | metadata ops |\n"
          "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def table(runs: dict[tuple, list[dict]], opened: dict[str, int | None]) -> list[str]:
    """Markdown rows, one per (file system, readers, pipeline); ratios against per-file on the same two."""
    lines = [HEADER]
    for (fs, readers, name), r in runs.items():
        rate = median(r, lambda x: x["samples"] / x["seconds"])
        base = median(runs[fs, readers, "per-file"], lambda x: x["samples"] / x["seconds"])
        fuse = bool(r[0]["server"])  # the local rows have no server counters
        server = lambda key: median(r, lambda x: x["server"][key]) if fuse else 0  # noqa: E731
        opens = server("opens") if fuse else opened.get(name) if readers == 1 else None
        cells = [fs, readers, name, f"{rate:,.0f}", _spread(r), f"{rate / base:.2f}x",
                 f"{median(r, lambda x: x['seconds']):.1f}",
                 f"{median(r, lambda x: x['cpu_s'] / x['samples'] * 1000):.3f}",
                 f"{median(r, lambda x: x['server'].get('cpu_s', 0) / x['samples'] * 1000):.3f}",
                 f"{median(r, lambda x: x['read_bytes']) / 1e6:,.0f}", f"{server('read_bytes') / 1e6:,.0f}",
                 _count(opens), _count(server("meta_ops") if fuse else None)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def _spread(runs: list[dict]) -> str:
    rates = [x["samples"] / x["seconds"] for x in runs]
    return f"{min(rates):,.0f}-{max(rates):,.0f}"


def _count(n: float | None) -> str:
    return "n/a" if n is None else f"{n:,.0f}"


def _list(kind: type, choices: tuple = ()) -> Callable[[str], list]:
    def parse(text: str) -> list:
        items = [kind(x) for x in text.split(",") if x]
        bad = [x for x in items if choices and x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list of {choices or kind.__name__}")
        return items
    return parse


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=50_000)
    p.add_argument("--workers", type=int, default=2, help="loader workers of each reader process")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default="/var/tmp/hpctrain-data-bench")
    p.add_argument("--warm", dest="cold", action="store_false", help="do not drop the page cache")
    p.add_argument("--fs", type=_list(str, FILE_SYSTEMS), default=["local"],
                   help="where to read, comma-separated: local, fuse (slowfs, no latency), slow (default local)")
    p.add_argument("--readers", type=_list(int), default=[1], help="concurrent reader processes, e.g. 1,2,4")
    p.add_argument("--slow-meta-ms", type=float, default=0.5, help="--fs slow: sleep per metadata operation")
    p.add_argument("--slow-read-ms", type=float, default=0.0, help="--fs slow: sleep per read request (<= 128 KiB)")
    p.add_argument("--slow-mb-per-s", type=float, default=1000.0, help="--fs slow: bandwidth cap over all readers")
    p.add_argument("--run", choices=PIPELINES, help=argparse.SUPPRESS)
    p.add_argument("--files", help=argparse.SUPPRESS)
    p.add_argument("--shards", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if min(args.readers) < 1:
        p.error(f"--readers {','.join(map(str, args.readers))}: each count must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    if args.run:
        args.readers = args.readers[0]
        one_pass(args)
        return
    started = time.perf_counter()
    files, shards = prepare(Path(args.workdir).resolve(), args.images)
    all_files = [*files.glob("class_*/*.jpg"), *shards.glob("*.tar")]
    with trees(args, files, shards) as found:
        runs: dict[tuple, list[dict]] = {(t.fs, n, p): [] for t in found for n in args.readers for p in PIPELINES}
        for _ in range(args.repeats):  # interleaved: a drift of the machine spreads over all rows alike
            for tree in found:
                for readers in args.readers:
                    for name in PIPELINES:
                        runs[tree.fs, readers, name].append(timed(name, args, tree, readers, all_files))
        local = [t for t in found if t.fs == "local"]
        opened = {n: files_opened(n, args, local[0]) for n in PIPELINES} if local and 1 in args.readers else {}
    first = next(iter(runs.values()))[0]
    print(f"\n{args.images} JPEGs {SIZE}x{SIZE}, {args.workers} workers per reader, batch {args.batch} per reader, "
          f"cache: {first['cache']}, median of {args.repeats}; slow: {args.slow_meta_ms} ms per metadata operation, "
          f"{args.slow_read_ms} ms per read request, {args.slow_mb_per_s:g} MB/s; "
          f"{time.perf_counter() - started:.0f} s in all\n")
    print("\n".join(table(runs, opened)))
    print("\nsamples per pass:", {f"{fs}/{n}/{p}": r[0]["samples"] for (fs, n, p), r in runs.items()})


if __name__ == "__main__":
    main()
