"""The face-parsing data path's cost per CPU core, and how many of a node's cores one GPU needs at the face-parsing
goals (2,000 training images/s at the reference batch 96, 1,200 at micro batch 16). Prints a table.

    python benchmarks/faceseg_decode.py [--faces 2000] [--size 256] [--samples 300] [--repeats 3]
                                        [--workers 1 2] [--batch 96] [--loader-batch 32] [--workdir DIR]
                                        [--json PATH]

Generated faces (hpctrain.datasets.faces) at --size, sharded as `hpctrain shard --format celebamask --resize SIZE`
writes them (JPEG image, PNG label map), through faceseg_throughput.prepare_shards. Then, in this process with one
torch thread (one core), --samples training samples of the experiment's own data path per stage, --repeats times
(median), after WARM untimed ones:

  read                  a sample's bytes from the shards (ShardDataset, no decoding)
  cpu-decode            what a loader worker does per sample on the CPU path: read, decode the JPEG and the label
                        PNG (torchvision.io), the training crop, resize and flip (the experiment's Resized and
                        train_transform, data.augment=true)
  gpu-decode, CPU share what stays on the CPU with model.gpu_decode=true: read, decode the (small) label PNG,
                        crop, resize and flip it (Encoded and encoded_crop_flip); the JPEG goes to nvJPEG as bytes
  collate               stacking a batch of --batch samples into the batch tensors (per image)

and then the loader itself (hpctrain's build_loader: worker processes; a CPU runtime, so no pinned memory, which
hpctrain's loader adds for GPU runs: a copy per batch in the main process) over the
cpu-decode path with each --workers count and over the gpu-decode path with one worker, images/s over an epoch of the training split in batches of --loader-batch (after each
worker's first batch), so the per-core rate is checked against what processes, pipes and pinning deliver. A worker count above the machine's cores measures sharing.

cores per GPU = goal rate / the path's per-core rate (worker processes of one rank), plus one core for the rank's
training process (its host-bound step needs a whole core). The per-core rate is one loader worker's where the
loader ran (its own costs included), else the stage's. The per-core rate is this machine's: a node's cores
(and their JPEG decoders' speed) differ; run it there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

GOALS = {"batch 96": 2000.0, "micro 16": 1200.0}
"""Images/s one GPU trains at the goals of the face-parsing issue (model-only)."""


def experiment_data(shards: Path, size: int, gpu_decode: bool):
    """The face-parsing experiment's own training data (datasets and transform) over ``shards``."""
    from hpctrain.resolution import resolve_config as resolve

    overrides = ("model.source=shards", f"model.data_root={shards}", f"model.image_size={size}", "data.augment=true",
                 f"model.gpu_decode={'true' if gpu_decode else 'false'}", "data.num_workers=0")
    cls, cfg = resolve("faceseg_celebamask", None, overrides)
    return cfg, cls(cfg).build_datasets()


WARM = 50
"""Calls before timing a stage: a process's first few dozen samples run at a fraction of the steady rate (first
calls of the decoders and of interpolate, the allocator growing: measured 55/s for the first 50, 375/s after)."""


def per_sample(fn: Callable[[int], Any], n: int, count: int, repeats: int) -> float:
    """Samples/s of fn(i) over ``n`` samples (indices cycling through ``count``), median of ``repeats``."""
    for i in range(min(WARM, count)):
        fn(i)
    rates = []
    for r in range(repeats):
        started = time.perf_counter()
        for i in range(n):
            fn((r * n + i) % count)
        rates.append(n / (time.perf_counter() - started))
    return statistics.median(rates)


def stage_rates(shards: Path, size: int, n: int, repeats: int, batch: int) -> dict[str, float]:
    """Per-core rates (samples/s, one torch thread) of each stage of the path."""
    from hpctrain.data.seeding import sample_generator
    from hpctrain.data.shardset import shard_dataset

    cfg, data = experiment_data(shards, size, gpu_decode=False)
    raw = shard_dataset(shards / "train", ["jpg", "png"], cfg.data, decode=False)
    count = len(data.train)

    def cpu(i: int) -> Any:
        return data.train_transform(data.train[i], sample_generator(0, 0, i))

    _, encoded = experiment_data(shards, size, gpu_decode=True)

    def gpu_share(i: int) -> Any:
        return encoded.train_transform(encoded.train[i], sample_generator(0, 0, i))

    samples = [cpu(i) for i in range(batch)]
    collate = torch.utils.data.default_collate
    return {
        "read": per_sample(lambda i: raw[i], n, count, repeats),
        "cpu-decode": per_sample(cpu, n, count, repeats),
        "gpu-decode, CPU share": per_sample(gpu_share, n, count, repeats),
        "collate": per_sample(lambda i: collate(samples), max(2, n // batch), 1, repeats) * batch,
    }


PATHS = {"cpu-decode": False, "gpu-decode, CPU share": True}
"""The two training data paths (model.gpu_decode)."""


def loader_rate(shards: Path, size: int, workers: int, batch: int, gpu_decode: bool = False) -> float:
    """Images/s of hpctrain's training loader on one path (not pinned: a CPU runtime) over one epoch, after each
    worker's first batch (its start-up and first-sample warm-up are not the steady rate)."""
    import dataclasses

    from hpctrain.config.batch import batch_sizes
    from hpctrain.data.loader import build_loader
    from hpctrain.data.sampler import StepBatchSampler
    from hpctrain.dist.runtime import single_process_runtime

    cfg, data = experiment_data(shards, size, gpu_decode=gpu_decode)
    data_cfg = dataclasses.replace(cfg.data, num_workers=workers, pin_memory=True)
    runtime = single_process_runtime(torch.device("cpu"))
    sampler = StepBatchSampler(len(data.train), batch_sizes(batch, batch, 1), 0, 0)
    loader = build_loader(data.train, sampler, data_cfg, runtime, collate_fn=data.collate_fn, transform=data.train_transform)
    batches = iter(loader)
    for _ in range(max(1, workers)):
        next(batches)
    started, images = time.perf_counter(), 0
    for b in batches:
        images += len(b.data) if hasattr(b, "data") else b[0].shape[0]  # EncodedBatch (gpu_decode) or tensors
    seconds = time.perf_counter() - started
    del batches
    return images / seconds if images else math.nan


def cores_per_gpu(rate_per_core: float) -> dict[str, float]:
    """Loader cores (one per worker process) per GPU at each goal; the training process's own core comes on top."""
    return {goal: rate / rate_per_core for goal, rate in GOALS.items()}


def per_core(stages: dict[str, float], loaders: dict[str, dict[int, float]]) -> dict[str, float]:
    """Each path's rate per core: one loader worker's where measured (the loader's own costs included: the sampler,
    collation, the pipe, a larger working set than a stage's 300 samples), else the stage's."""
    return {path: loaders.get(path, {}).get(1) or stages[path] for path in PATHS}


def render(head: list[str], stages: dict[str, float], loaders: dict[str, dict[int, float]], cores: int) -> str:
    lines = head + ["", "| stage (one core, in this process) | samples/s per core | ms per sample |", "|---|---:|---:|"]
    for name, rate in stages.items():
        lines.append(f"| {name} | {rate:,.0f} | {1000 / rate:.2f} |")
    if loaders:
        lines += ["", "| hpctrain's loader | workers | images/s | per worker | per worker vs the stage |",
                  "|---|---:|---:|---:|---:|"]
        for path, rates in loaders.items():
            for workers, rate in rates.items():
                lines.append(f"| {path} | {workers} (on {cores} cores) | {rate:,.0f} | {rate / workers:,.0f} | "
                             f"{rate / min(workers, cores) / stages[path]:.2f} |")
    rates = per_core(stages, loaders)
    lines += ["", "| path | per core (images/s) | loader cores per GPU at 2,000/s (batch 96) | at 1,200/s (micro 16) |",
              "|---|---:|---:|---:|"]
    for path, rate in rates.items():
        need = cores_per_gpu(rate)
        lines.append(f"| {path} | {rate:,.0f} | {need['batch 96']:.1f} | {need['micro 16']:.1f} |")
    return "\n".join(lines)


def verdict(rates: dict[str, float]) -> list[str]:
    """Which path a node of a given core count per GPU should use, from the per-core rates of per_core()."""
    cpu = math.ceil(cores_per_gpu(rates["cpu-decode"])["batch 96"])
    gpu = math.ceil(cores_per_gpu(rates["gpu-decode, CPU share"])["batch 96"])
    lines = [f"At these per-core rates one GPU at 2,000 images/s needs {cpu} loader cores with the CPU decode path "
             f"and {gpu} with nvJPEG (model.gpu_decode=true), each plus one for the rank's training process."]
    if gpu < cpu:
        middle = f"{gpu + 1}" if gpu + 1 == cpu else f"{gpu + 1} to {cpu}"
        lines.append(f"A node with at least {cpu + 1} cores per GPU can decode on the CPU (the GPU's time stays with "
                     f"the model); with {middle} per GPU, decode on the GPU; with fewer, neither keeps up.")
    else:
        lines.append("nvJPEG saves no CPU time here (the label PNG's decode and crop dominate the CPU's share): "
                     "decode on the CPU, which leaves the GPU's time to the model.")
    return lines


def header(args: argparse.Namespace, info: dict[str, Any]) -> list[str]:
    from hpctrain.provenance import cpu_model

    return [f"# faceseg_decode: {info['train_samples']} generated faces at {args.size}x{args.size} "
            f"({info['train_bytes'] / info['train_samples'] / 1e3:.1f} kB per sample in shards), {cpu_model()}, "
            f"{os.cpu_count()} cores, torch {torch.__version__}, {datetime.date.today().isoformat()}"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faces", type=int, default=2000, help="generated faces (80%% for training)")
    p.add_argument("--size", type=int, default=256, help="image side in the shards and for training")
    p.add_argument("--samples", type=int, default=300, help="samples per timed stage")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=96, help="collate's batch")
    p.add_argument("--loader-batch", dest="loader_batch", type=int, default=32,
                   help="the loader's batch (small enough for a few batches per worker in an epoch)")
    p.add_argument("--workers", type=int, nargs="*", default=[1, 2], help="loader worker counts to run (none: skip)")
    p.add_argument("--workdir", default="", metavar="DIR", help="keep the generated shards here (reused)")
    p.add_argument("--json", default="", metavar="PATH")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from faceseg_throughput import prepare_shards

    args = parser().parse_args(argv)
    torch.set_num_threads(1)  # one core: the per-core rate; a loader worker runs with one thread too
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(args.workdir or scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        settings = argparse.Namespace(faces=args.faces, size=args.size, cuda=False)
        # Generated on all cores (their speed is not what is measured here).
        shards, info = prepare_shards(settings, workdir, lambda line: print(line, file=sys.stderr), all_cores=True)
        stages = stage_rates(shards, args.size, args.samples, args.repeats, args.batch)
        loaders: dict[str, dict[int, float]] = {}
        if args.workers:
            loaders["cpu-decode"] = {w: loader_rate(shards, args.size, w, args.loader_batch) for w in args.workers}
            loaders["gpu-decode, CPU share"] = {1: loader_rate(shards, args.size, 1, args.loader_batch, gpu_decode=True)}
    rates = per_core(stages, loaders)
    text = "\n".join([render(header(args, info), stages, loaders, os.cpu_count() or 1), "", *verdict(rates)])
    print(text)
    result = {"stages": stages, "loaders": loaders, "shards": info, "per_core": rates,
              "cores_per_gpu": {k: cores_per_gpu(v) for k, v in rates.items()}}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
