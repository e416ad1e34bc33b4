"""Loader throughput: one JPEG file per sample vs hpctrain shards vs the webdataset library. Prints a table.

    python benchmarks/data_throughput.py [--images 50000] [--workers 2] [--repeats 3] [--workdir DIR]

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
  whose re-reading would dominate time and bytes. Passes are interleaved (a, b, c, a, b, c, ...); medians over ``--repeats``.
- Each pass runs in a fresh process; imports and loader construction are not timed. CPU time (user +
  system of the process and its workers) and bytes read from the block device come from ``getrusage``
  (self + reaped children) around the epoch, the workers being joined before the second reading. Files opened
  come from one extra ``strace -f -e trace=openat`` pass per pipeline (not timed), when strace exists.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PIPELINES = ("per-file", "hpctrain", "webdataset")
SIZE = 64


def prepare(workdir: Path, images: int) -> tuple[Path, Path]:
    import numpy as np
    from PIL import Image

    from hpctrain.data.fixtures import pattern_image
    from hpctrain.data.shard_command import ShardRequest, shard_command

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
    from torchvision.io import decode_jpeg

    return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))


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


def loader(name: str, files: Path, shards: Path, workers: int, batch: int):
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    common = {"num_workers": workers, "multiprocessing_context": "fork" if workers else None}
    if name == "per-file":
        ds = PerFile(files)
        return DataLoader(ds, batch_size=batch, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(0)),
                          **common)
    if name == "hpctrain":
        from hpctrain.config.batch import plan_batches
        from hpctrain.config.schema import DataSection
        from hpctrain.data.loader import build_loader
        from hpctrain.data.sampler import StepBatchSampler
        from hpctrain.data.shardset import ShardDataset
        from hpctrain.dist.runtime import Runtime

        ds = ShardDataset(shards, ["jpg", "cls"])  # decodes with torchvision too
        sampler = StepBatchSampler(len(ds), plan_batches(batch, batch, 1), 0, seed=0, order=ds.epoch_order)
        runtime = Runtime(launcher="single", rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                          num_nodes=1, master_addr="", master_port=0, hostname="bench", job_id="",
                          device=torch.device("cpu"), backend="")
        cfg = DataSection(num_workers=workers, worker_start="fork", persistent_workers=False)
        return build_loader(ds, sampler, cfg, runtime, seed=0)
    import webdataset as wds

    urls = sorted(str(p) for p in shards.glob("*.tar"))
    pipeline = wds.WebDataset(urls, shardshuffle=len(urls), seed=0, empty_check=False).shuffle(4096).map(_wds_sample)
    return DataLoader(pipeline.batched(batch), batch_size=None, **common)


def one_pass(args: argparse.Namespace) -> None:
    files, shards = Path(args.files), Path(args.shards)
    # Imports (torchvision's decoders load lazily) and loader construction are not what is measured.
    _decode(next(files.glob("class_0/*.jpg")).read_bytes())
    batches = loader(args.run, files, shards, args.workers, args.batch)
    before = _usage()
    started = time.perf_counter()
    count = 0
    for images, _labels in batches:
        count += len(images)
    seconds = time.perf_counter() - started
    del batches, images
    gc.collect()  # the loaders' workers are joined (reaped) here, so their usage is counted below
    after = _usage()
    print(json.dumps({"samples": count, "seconds": seconds, "cpu_s": after[0] - before[0],
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


def drop_caches(paths: list[Path]) -> str:
    """Evict the data files (only them) from the page cache, then, where allowed (root), the dentry and
    inode caches, so that opening a file costs its metadata lookups again. Not the whole page cache
    (drop_caches=1): that also evicts Python, torch and their libraries, whose re-reading would then
    dominate both the time and the bytes read."""
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


def timed(name: str, args: argparse.Namespace, files: Path, shards: Path, all_files: list[Path]) -> dict:
    method = drop_caches(all_files) if args.cold else "warm"
    cmd = [sys.executable, __file__, "--run", name, "--files", str(files), "--shards", str(shards),
           "--workers", str(args.workers), "--batch", str(args.batch)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "cache": method}


def files_opened(name: str, args: argparse.Namespace, files: Path, shards: Path) -> int | None:
    if not shutil.which("strace"):
        return None
    log = Path(args.workdir) / f"strace_{name}.log"
    cmd = ["strace", "-f", "-qq", "-e", "trace=openat", "-o", str(log), sys.executable, __file__, "--run", name,
           "--files", str(files), "--shards", str(shards), "--workers", str(args.workers), "--batch", str(args.batch)]
    subprocess.run(cmd, capture_output=True, check=True)
    root = str(Path(args.workdir).resolve())
    count = sum(1 for line in log.read_text().splitlines() if root in line and "ENOENT" not in line and "O_DIRECTORY" not in line)
    log.unlink()
    return count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=50_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default="/var/tmp/hpctrain-data-bench")
    p.add_argument("--warm", dest="cold", action="store_false", help="do not drop the page cache")
    p.add_argument("--run", choices=PIPELINES, help=argparse.SUPPRESS)
    p.add_argument("--files", help=argparse.SUPPRESS)
    p.add_argument("--shards", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        one_pass(args)
        return
    files, shards = prepare(Path(args.workdir), args.images)
    all_files = [*files.glob("class_*/*.jpg"), *shards.glob("*.tar")]
    runs: dict[str, list[dict]] = {n: [] for n in PIPELINES}
    for _ in range(args.repeats):
        for name in PIPELINES:
            runs[name].append(timed(name, args, files, shards, all_files))
    opened = {n: files_opened(n, args, files, shards) for n in PIPELINES}
    base = statistics.median(r["samples"] / r["seconds"] for r in runs["per-file"])
    print(f"\n{args.images} JPEGs {SIZE}x{SIZE}, {args.workers} workers, batch {args.batch}, "
          f"cache: {runs['per-file'][0]['cache']}, median of {args.repeats}\n")
    print("| pipeline | samples/s | vs per-file | CPU ms/sample | MB read from disk | files opened |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in PIPELINES:
        r = runs[name]
        rate = statistics.median(x["samples"] / x["seconds"] for x in r)
        cpu = statistics.median(x["cpu_s"] / x["samples"] * 1000 for x in r)
        mb = statistics.median(x["read_bytes"] for x in r) / 1e6
        print(f"| {name} | {rate:,.0f} | {rate / base:.2f}x | {cpu:.3f} | {mb:,.0f} | "
              f"{opened[name] if opened[name] is not None else 'n/a'} |")
    print("\nsamples per pass:", {n: runs[n][0]["samples"] for n in PIPELINES})


if __name__ == "__main__":
    main()
