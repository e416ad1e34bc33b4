"""Start-up of a large shard set: the index a rank parses, the copy each loader worker receives, the shard stats.

    python benchmarks/archive/2026-11/index_startup.py [--samples 1000000] [--shards 10000] [--repeats 3] [--before SRC]

Method
- A generated shard set of ``--samples`` samples in ``--shards`` shards, in hpctrain's on-disk format (index.json,
  manifest.json), whose .tar files are sparse files of the manifest's sizes (no image data is needed: nothing
  here reads a sample). Kept in --workdir between runs.
- Each measurement is a fresh process that imports hpctrain from a source tree and constructs ``ShardDataset``:
  wall time of the constructor, the process's resident memory added by it (VmRSS before and after), the size of
  the dataset pickled (what every loader worker receives under forkserver or spawn), and the time to unpickle it.
- ``--before SRC`` measures another source tree beside this one (e.g. a checkout of the commit before the
  memory-mapped index) in the same run, passes interleaved; medians over ``--repeats``.
- New code: "first" is the first construction after index.json was written (it builds the memory-mapped arrays
  once per shard set), "then" every later one (another rank, a worker, the next job).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # benchmarks/archive/2026-11/ -> the checkout

PROBE = r"""
import json, pickle, sys, time
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
import numpy, torch  # imported before the measurement: their memory is not the index's
from hpctrain.data.shardset import ShardDataset
before = rss_mb()
t0 = time.perf_counter()
ds = ShardDataset(sys.argv[1], ["png", "cls"])
built = time.perf_counter() - t0
after = rss_mb()
blob = pickle.dumps(ds)
t0 = time.perf_counter()
pickle.loads(blob)
unpickled = time.perf_counter() - t0
print(json.dumps({"samples": len(ds), "construct_s": built, "rss_mb": after - before, "pickle_mb": len(blob) / 1e6,
                  "unpickle_s": unpickled, "key": ds.locate(len(ds) - 1).key}))
"""


def make_set(split: Path, samples: int, shards: int) -> None:
    """index.json and manifest.json as `hpctrain shard` writes them, sparse .tar files of the listed sizes."""
    if (split / "manifest.json").exists():
        return
    split.mkdir(parents=True, exist_ok=True)
    per, entries, manifest, n = -(-samples // shards), [], [], 0
    for s in range(shards):
        count = min(per, samples - n)
        keys = [f"{n + i:09d}" for i in range(count)]
        offsets = [512 + i * 3072 for i in range(count)]
        entries.append({"name": f"train-{s:06d}.tar", "keys": keys,
                        "members": {"png": [[o + 512, 2048] for o in offsets], "cls": [[o + 2048 + 1024, 1] for o in offsets]}})
        size = 512 + count * 3072 + 1024
        with open(split / f"train-{s:06d}.tar", "wb") as f:
            f.truncate(size)
        manifest.append({"name": f"train-{s:06d}.tar", "samples": count, "bytes": size, "sha256": ""})
        n += count
    (split / "index.json").write_text(json.dumps({"format": 1, "shards": entries}, separators=(",", ":")))
    (split / "manifest.json").write_text(json.dumps({"format": 1, "samples": n, "shards": manifest}))


def forget_cache(split: Path) -> None:
    """The memory-mapped index is rebuilt on the next construction (what the first run after `hpctrain shard` does)."""
    shutil.rmtree(split / ".index-cache", ignore_errors=True)


def probe(src: Path, split: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"):
        env.pop(key, None)  # one process: every construction checks the sizes itself (the per-rank cost)
    out = subprocess.run([sys.executable, "-c", PROBE, str(split)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_row(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in ("construct_s", "rss_mb", "pickle_mb", "unpickle_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another hpctrain source tree (its src/) to measure beside this one")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "hpctrain-index-bench")
    args = parser.parse_args()
    split = args.workdir / f"{args.samples}-{args.shards}" / "train"
    make_set(split, args.samples, args.shards)
    trees = ([("before", args.before)] if args.before else []) + [("this tree", ROOT / "src")]
    rows: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for name, src in trees:
            if name == "this tree":
                forget_cache(split)
                rows.setdefault("this tree, first", []).append(probe(src, split))
                rows.setdefault("this tree, then", []).append(probe(src, split))
            else:
                rows.setdefault(name, []).append(probe(src, split))
    print(f"{args.samples:,} samples in {args.shards:,} shards; medians of {args.repeats}\n")
    print("| code | construct (s) | memory added (MB) | pickled for each worker (MB) | unpickle (s) |")
    print("|---|---|---|---|---|")
    for name, runs in rows.items():
        m = median_row(runs)
        print(f"| {name} | {m['construct_s']:.2f} | {m['rss_mb']:.0f} | {m['pickle_mb']:.2f} | {m['unpickle_s']:.3f} |")


if __name__ == "__main__":
    main()
