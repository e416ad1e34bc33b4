"""Face parsing reference experiment (faceseg_celebamask): training throughput per GPU, model-only and end-to-end
from shards, hpctrain's loop against a plain torch loop on the same model, in one process and one run. Prints a
table.

    python benchmarks/faceseg_throughput.py [--device auto|cuda|cpu] [--batches 16 32] [--steps 50] [--warmup 10]
                                            [--repeats 5] [--backbone resnet101] [--size 256] [--output-stride 16]
                                            [--smoke] [--compile | --no-compile] [--e2e cpu,gpu] [--faces 5000]
                                            [--workers -1] [--workdir DIR] [--json PATH]

For each batch (= the global batch: one process) on DeepLabV3+ at 256x256, rows: "plain" (a hand-written torch loop,
captured by hand under --step-mode graphed), "hpctrain" (its own loop, data on the device), and end to end from
generated, sharded faces (--workdir keeps them): "e2e cpu-decode" (the loader's workers decode) and "e2e gpu-decode"
(model.gpu_decode=true, nvJPEG). Model-only loops alternate window by window; end-to-end windows run back to back;
medians [min, max]. A second table says which goals are met (one H100, reference configuration: model-only >= 2,000
images/s, end to end >= 90% of it, hpctrain >= 0.97 x plain). Without CUDA (or with --smoke) a small model runs as
a smoke test: its numbers say nothing about a GPU. benchmarks/throughput.md gives the method and each column in
full; the harness is throughput_common.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.flop_counter import FlopCounterMode

from hpctrain.config.schema import RunConfig
from hpctrain.experiments.faceseg.experiment import IGNORE_INDEX, MEAN, STD, FaceSegCelebAMask
from hpctrain.perf.peaks import dense_peak

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is no package: the shared helpers beside us
from throughput_common import (HpctrainLoop, ReplayedPlain, add_device_argument, alternate_windows,  # noqa: E402
                               add_window_arguments, allocated, device_name, gib, log, log_window, median_ratio,
                               paired_ratio, peak_fraction, peak_of, quiet_run_overrides, release, report_environment,
                               resolve_device, spread, timed_window, title_line, warm_libraries, window_rates, windows,
                               write_json)

EXPERIMENT = "faceseg_celebamask"
NUM_CLASSES = 19
MODEL_ONLY = ("plain", "hpctrain")
E2E = {"cpu": "e2e cpu-decode", "gpu": "e2e gpu-decode"}
"""--e2e choice -> row name."""
SHARD_BYTES = 10**9
"""`hpctrain shard`'s default --shard-size (1GB)."""
REFERENCE = {"backbone": "resnet101", "size": 256, "output_stride": 16, "aspp": 256, "decoder": 256}
SMOKE = {"backbone": "resnet18", "size": 64, "output_stride": 16, "aspp": 32, "decoder": 32}
"""The smoke test's small DeepLabV3+."""
REFERENCE_GFLOP = 132.6
"""FlopCounterMode's forward + backward GFLOP per training image at the reference configuration (44.3 forward)."""
GOAL_IMAGES_PER_S = 2000.0
GOAL_E2E_FRACTION = 0.90
GOAL_VS_PLAIN = 0.97


@dataclass(frozen=True)
class Settings:
    device: torch.device
    batches: tuple[int, ...]
    steps: int
    warmup: int
    repeats: int
    compile: bool
    backbone: str
    size: int
    output_stride: int
    aspp: int
    decoder: int
    samples: int
    """Generated images on the device for the model-only loops (each loop its own copy)."""
    e2e: tuple[str, ...]
    """End-to-end paths: 'cpu' (loader decode), 'gpu' (model.gpu_decode)."""
    faces: int
    workers: int
    smoke: bool
    cudnn_benchmark: bool = False
    workdir: str = ""
    step_mode: str = "eager"
    """hpctrain's train.step_mode in every hpctrain row; graphed: the plain loop is captured by hand (PlainGraphed)."""
    channels_last: bool = True
    """channels_last memory format in both loops (train.channels_last for hpctrain)."""
    name: str = "cpu"
    """The device's name (torch.cuda.get_device_name): the table's, and the key of its peak."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def precision(self) -> str:
        return "bf16" if self.cuda else "fp32"

    @property
    def reference(self) -> bool:
        """The reference configuration (what the goals are stated for)."""
        return self.cuda and not self.smoke and (self.backbone, self.size, self.output_stride, self.aspp,
                                                 self.decoder) == tuple(REFERENCE.values())


@dataclass
class Measured:
    """One loop at one batch."""

    loop: str
    batch: int
    seconds: list[float] = field(default_factory=list)
    """Each timed window's wall time."""
    resident_bytes: int = 0
    transient_bytes: int = 0


# ---- configuration ------------------------------------------------------------------------------------------

def step_mode_for(s: Settings, path: str) -> str:
    """hpctrain's step mode for a row: the gpu-decode row's batches hold JPEG bytes, which a CUDA graph cannot take
    as inputs, so under --step-mode graphed that row runs eagerly (compiled with --compile), as auto would."""
    if path == "gpu" and s.step_mode == "graphed":
        return "compiled" if s.compile else "eager"
    return s.step_mode


def overrides(s: Settings, batch: int, run_dir: str, path: str = "", shards: str = "") -> list[str]:
    """hpctrain's config for one batch: the batch is the global batch (one process, accumulation 1). path '' is
    model-only (data on the device), 'cpu' or 'gpu' end-to-end from ``shards``."""
    out = [
        f"model.backbone={s.backbone}", f"model.image_size={s.size}", f"model.output_stride={s.output_stride}",
        f"model.aspp_channels={s.aspp}", f"model.decoder_channels={s.decoder}", "model.init=scratch",
        f"train.precision={s.precision}", f"train.channels_last={'true' if s.channels_last else 'false'}",
        # the benchmark's setting for both loops (hpctrain's auto would turn it on for a graphed step only)
        f"train.cudnn_benchmark={'on' if s.cudnn_benchmark else 'off'}",
        f"train.compile={'true' if s.compile else 'false'}", f"train.step_mode={step_mode_for(s, path)}",
        *quiet_run_overrides(batch, run_dir),
    ]
    if not path:
        return out + ["data.on_device=true", "data.augment=false", "data.num_workers=0"]
    return out + ["model.source=shards", f"model.data_root={shards}", f"model.gpu_decode={str(path == 'gpu').lower()}",
                  "data.on_device=false", "data.augment=true", f"data.num_workers={s.workers}"]


def load(s: Settings, batch: int, run_dir: str, path: str = "", shards: str = ""):
    from hpctrain.resolution import resolve_config as resolve

    cls, cfg = resolve(EXPERIMENT, None, tuple(overrides(s, batch, run_dir, path, shards)))
    if not issubclass(cls, FaceSegCelebAMask):
        raise RuntimeError(f"{EXPERIMENT} resolves to {cls.__name__}, not the face-parsing experiment")
    return cls, cfg


def device_data(n: int, size: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n uint8 RGB images (n x 3 x size x size) and label maps (n x size x size, classes 0..18) on ``device``:
    random, which changes nothing of the work of a dense model."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, device=device, generator=g)
    labels = torch.randint(0, NUM_CLASSES, (n, size, size), dtype=torch.uint8, device=device, generator=g)
    return images, labels


class OnDeviceFaceSeg(FaceSegCelebAMask):
    """faceseg_celebamask with a TensorDataset training set (for data.on_device=true) and no validation set;
    model, loss, parameter groups and everything else are the experiment's own."""

    tensors: tuple[torch.Tensor, ...] = ()

    def build_datasets(self):
        from torch.utils.data import TensorDataset

        from hpctrain.experiments.base import Datasets

        return Datasets(train=TensorDataset(*self.tensors))


# ---- the loops -----------------------------------------------------------------------------------------------

class PlainLoop:
    """What one would write by hand for the reference run on one GPU."""

    def __init__(self, experiment, cfg: RunConfig, device: torch.device, compile_model: bool, samples: int) -> None:
        t, opt = cfg.train, cfg.optim
        self.device, self.batch_size, self.size = device, t.micro_batch_size, experiment.options.image_size
        self.channels_last = t.channels_last
        self.dtype = torch.bfloat16 if t.precision == "bf16" else None
        self.autocast_cache = True
        """Off in a captured loop, warm-up included: a compiled model would see another autocast state in the
        capture than in its warm-up steps and recompile there (hpctrain's graphed step does the same)."""
        torch.manual_seed(cfg.run.seed)
        raw = experiment.build_model().to(device)
        self.raw = raw.to(memory_format=torch.channels_last) if self.channels_last else raw
        self.model = torch.compile(self.raw) if compile_model else self.raw
        self.optimizer = torch.optim.SGD(self.raw.parameters(), lr=opt.lr, momentum=opt.momentum,
                                         nesterov=opt.momentum > 0, weight_decay=opt.weight_decay)
        warm = max(opt.warmup_steps, 1)
        self.scheduler = LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / warm))
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
        self.images, self.labels = device_data(samples, self.size, device, cfg.run.seed + 1)
        self.order, self.at = torch.empty(0, dtype=torch.long), samples  # a new epoch at the first step

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=self.autocast_cache)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        m, n = self.batch_size, len(self.images)
        if self.at + m > n:
            self.order, self.at = torch.randperm(n, device=self.device), 0
        index = self.order[self.at : self.at + m]
        self.at += m
        x = (self.images[index].float().div_(255.0) - self.mean) / self.std
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, self.labels[index].long()

    def loss(self, model: torch.nn.Module) -> torch.Tensor:
        x, y = self.batch()
        with self.autocast():
            logits = model(x)
        return F.cross_entropy(logits.float(), y, ignore_index=IGNORE_INDEX)

    def step(self) -> None:
        self.loss(self.model).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def warm(self, steps: int) -> None:
        self.run(steps)

    def flops_per_step(self) -> int:
        """Forward + backward of one training step on the uncompiled model (the optimizer's elementwise work is
        not counted: FlopCounterMode counts matrix multiplies and convolutions)."""
        with FlopCounterMode(display=False) as counter:
            self.loss(self.raw).backward()
        self.optimizer.zero_grad(set_to_none=True)
        return counter.get_total_flops()


class ContinuingLoader:
    """ctx.train_loader for the end-to-end windows: hpctrain's loader, whose iterator is kept when the loop asks
    for the batches from where the last window stopped (as one long run would go on), and started afresh
    otherwise (a new epoch). One batch per step: the batch is the micro batch."""

    def __init__(self, loader: Any, sampler: Any) -> None:
        self.loader, self.sampler = loader, sampler
        self._it: Iterator[Any] | None = None
        self._at: tuple[int, int] = (-1, -1)
        self.starts = 0
        """How often the underlying iterator started (epochs of the generated set, and the first)."""

    def __len__(self) -> int:
        return len(self.loader)

    def take_skipped(self) -> list[str]:
        return self.loader.take_skipped()

    def __iter__(self) -> "ContinuingLoader":
        at = (self.sampler.epoch, self.sampler.start_step)
        if self._it is None or at != self._at:
            self._it, self._at = iter(self.loader), at
            self.starts += 1
        return self

    def __next__(self) -> Any:
        if self._it is None:
            raise StopIteration
        try:
            item = next(self._it)
        except StopIteration:
            self._it = None
            raise
        self._at = (self._at[0], self._at[1] + 1)
        return item


def continuing_loop(experiment, cfg: RunConfig, device: torch.device) -> HpctrainLoop:
    """hpctrain's loop with its loader going on across timed windows (see ContinuingLoader)."""
    hpc = HpctrainLoop(experiment, cfg, device)
    if hpc.ctx.batches.grad_accum != 1:
        raise RuntimeError("the continuing loader counts one batch a step: needs micro batch = batch")
    hpc.ctx.train_loader = ContinuingLoader(hpc.ctx.train_loader, hpc.ctx.sampler)
    return hpc


# ---- the face set ----------------------------------------------------------------------------------------------

def generate_faces(root: Path, count: int, size: int, seed: int = 0, processes: int = 1) -> Path:
    """``count`` faces at ``size`` (masks at half of it) in the CelebAMask-HQ layout, in parts on ``processes``
    processes (image i depends only on (seed, i), so the set is the same either way), then the split files."""
    from hpctrain.datasets.faces import make_faces, write_split_files
    from hpctrain.datasets.sources import celebamask

    mask = max(8, size // 2)
    if processes <= 1 or count < 200:
        return make_faces(root, count, size, mask, seed)
    import concurrent.futures
    import multiprocessing

    parts = min(processes * 4, count)
    bounds = [count * i // parts for i in range(parts + 1)]
    # spawn: this process may already hold a CUDA context, which a forked child must not inherit.
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs = [pool.submit(make_faces, root, b - a, size, mask, seed, standard_split=False, start_id=a)
                for a, b in zip(bounds, bounds[1:]) if b > a]
        for job in jobs:
            job.result()
    write_split_files(root, celebamask.image_ids(root))
    return root


def prepare_shards(s: Settings, workdir: Path, log: Callable[[str], None],
                   all_cores: bool = False) -> tuple[Path, dict[str, Any]]:
    """Generated faces, sharded as `hpctrain shard SRC OUT --format celebamask --resize SIZE` writes them; reused
    when ``workdir`` already holds them for this count and size. Generated by up to 16 processes on CUDA (or with
    all_cores), by one on the CPU smoke test (whose timings share the cores)."""
    from hpctrain.datasets.shard_writer import ShardRequest, write_shards as shard_command

    shards = workdir / "shards"
    marker = workdir / f"ready-{s.faces}-{s.size}.json"
    if marker.exists() and (shards / "train").is_dir():
        return shards, json.loads(marker.read_text())
    src = workdir / "faces"
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(shards, ignore_errors=True)
    for old in workdir.glob("ready-*.json"):
        old.unlink()
    started = time.perf_counter()
    processes = min(os.cpu_count() or 1, 16) if s.cuda or all_cores else 1
    generate_faces(src, s.faces, s.size, seed=0, processes=processes)
    generated = time.perf_counter()
    shard_command(ShardRequest(src, shards, "celebamask", SHARD_BYTES, resize=s.size, force=True))
    done = time.perf_counter()
    manifest = json.loads((shards / "train" / "manifest.json").read_text())
    info = {"faces": s.faces, "size": s.size, "train_samples": manifest["samples"],
            "train_bytes": sum(x["bytes"] for x in manifest["shards"]), "train_shards": len(manifest["shards"]),
            "generate_s": round(generated - started, 1), "shard_s": round(done - generated, 1),
            "generate_processes": processes}
    shutil.rmtree(src, ignore_errors=True)  # the shards are what is read
    marker.write_text(json.dumps(info) + "\n")
    log(f"  faces: {s.faces} at {s.size}x{s.size} generated in {info['generate_s']:.1f} s ({processes} processes), "
        f"sharded in {info['shard_s']:.1f} s: {info['train_samples']} training samples, "
        f"{info['train_bytes'] / 1e6:.1f} MB")
    return shards, info


# ---- measuring -----------------------------------------------------------------------------------------------

class PlainGraphed(ReplayedPlain):
    """The plain loop's step captured by hand (throughput_common.ReplayedPlain): forward, the loss, backward, fused
    SGD (one kernel per group instead of a foreach chain; a tensor learning rate the graph reads)."""

    def __init__(self, plain: PlainLoop) -> None:
        super().__init__(plain)
        plain.autocast_cache = False
        # made before the loop's first step (flops_per_step takes none): the peak rate, as the eager loop's was
        g, peak = plain.optimizer.param_groups[0], plain.scheduler.base_lrs[0]
        plain.optimizer = torch.optim.SGD(plain.raw.parameters(), lr=peak, momentum=g["momentum"],
                                          nesterov=g["nesterov"], weight_decay=g["weight_decay"], fused=True)
        plain.scheduler = LambdaLR(plain.optimizer, plain.scheduler.lr_lambdas[0])

    def record(self, static: list[torch.Tensor]) -> None:
        p = self.plain
        x, y = static
        with p.autocast():
            logits = p.model(x)
        F.cross_entropy(logits.float(), y, ignore_index=IGNORE_INDEX).backward()
        p.optimizer.step()


def measure_model_only(s: Settings, batch: int, log: Callable[[str], None]) -> tuple[dict[str, Measured], int, int]:
    """Both model-only loops at one batch; returns (measured, FLOP per step, parameters)."""
    measured = {name: Measured(name, batch) for name in MODEL_ONLY}
    with tempfile.TemporaryDirectory(prefix="hpctrain-faceseg-bench-") as run_dir:
        _, cfg = load(s, batch, run_dir)
        warm_libraries(s.device)
        start = allocated(s.device)
        plain = PlainLoop(FaceSegCelebAMask(cfg), cfg, s.device, s.compile, s.samples)
        params = sum(p.numel() for p in plain.raw.parameters())
        flops = plain.flops_per_step()
        if s.step_mode == "graphed":
            plain = PlainGraphed(plain)
        plain.warm(s.warmup)
        after_plain = allocated(s.device)
        experiment = OnDeviceFaceSeg(cfg)
        experiment.tensors = device_data(s.samples, s.size, s.device, cfg.run.seed + 1)
        hpc = HpctrainLoop(experiment, cfg, s.device)
        del experiment
        hpc.warm(s.warmup)
        after_hpc = allocated(s.device)
        measured["plain"].resident_bytes = after_plain - start
        measured["hpctrain"].resident_bytes = after_hpc - after_plain
        loops = {"plain": plain.run, "hpctrain": hpc.run}
        alternate_windows(loops, measured, batch, s.steps, s.repeats, s.device, log, f"batch {batch}")
        del plain, hpc, loops
    release(s.device, s.compile)
    return measured, flops, params


def measure_e2e(s: Settings, batch: int, path: str, shards: Path, log: Callable[[str], None]) -> tuple[Measured, int]:
    """hpctrain from the shards at one batch, one decode path; returns (measured, loader starts)."""
    name = E2E[path]
    m = Measured(name, batch)
    with tempfile.TemporaryDirectory(prefix="hpctrain-faceseg-bench-") as run_dir:
        cls, cfg = load(s, batch, run_dir, path, str(shards))
        warm_libraries(s.device)
        start = allocated(s.device)
        hpc = continuing_loop(cls(cfg), cfg, s.device)
        hpc.warm(s.warmup)
        m.resident_bytes = allocated(s.device) - start
        for r in range(s.repeats):
            timed_window(hpc.run, s.steps, s.device, m)
            log_window(log, f"batch {batch}", name, batch, r, m.seconds[-1], s.steps)
        starts = hpc.ctx.train_loader.starts
        del hpc
    release(s.device, s.compile)
    return m, starts


# ---- reporting -----------------------------------------------------------------------------------------------

def rates(m: Measured, steps: int) -> list[float]:
    """Images per second of each timed window."""
    return window_rates(m.batch, m.seconds, steps)


def rows(s: Settings, results: list[tuple[dict[str, Measured], int]]) -> list[dict[str, Any]]:
    """One row per loop and batch, as plain numbers (the JSON and the table). ``results``: per batch, its
    measured loops by name (plain and hpctrain first) and the FLOP of one step."""
    peak = dense_peak(s.name) if s.cuda else None
    out = []
    for measured, flops in results:
        plain_rates, hpc_rates = rates(measured["plain"], s.steps), rates(measured["hpctrain"], s.steps)
        for name, m in measured.items():
            r = rates(m, s.steps)
            per_image = flops / m.batch
            tflops = statistics.median(r) * per_image / 1e12
            if name == "plain":
                vs, vs_what = None, ""
            elif name == "hpctrain":
                vs, vs_what = paired_ratio(r, plain_rates), "plain"
            else:
                vs, vs_what = median_ratio(r, hpc_rates), "model-only"
            out.append({
                "loop": name, "batch": m.batch, "steps": s.steps, "repeats": s.repeats,
                "window_s": m.seconds, "images_per_s": r, "images_per_s_median": statistics.median(r),
                "ms_per_step_median": 1e3 * statistics.median(m.seconds) / s.steps,
                "flop_per_step": flops, "gflop_per_image": per_image / 1e9, "tflops_median": tflops,
                "peak_fraction": peak_fraction(tflops, peak, s.precision) if s.cuda else None,
                "peak_memory_bytes": m.resident_bytes + m.transient_bytes if s.cuda else None,
                "resident_bytes": m.resident_bytes if s.cuda else None,
                "vs": vs, "vs_what": vs_what,
            })
    return out


def goals(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals per batch: [{goal, batch, value, met}] (value None: the row was not measured)."""
    by = {(r["loop"], r["batch"]): r for r in table}
    out = []
    for batch in sorted({r["batch"] for r in table}):
        hpc = by.get(("hpctrain", batch))
        checks = [(f"model-only (hpctrain) >= {GOAL_IMAGES_PER_S:,.0f} images/s",
                   hpc["images_per_s_median"] if hpc else None, GOAL_IMAGES_PER_S),
                  (f"hpctrain >= {GOAL_VS_PLAIN:.2f} x plain", hpc["vs"] if hpc else None, GOAL_VS_PLAIN)]
        for name in E2E.values():
            row = by.get((name, batch))
            checks.append((f"{name} >= {GOAL_E2E_FRACTION:.0%} of model-only", row["vs"] if row else None,
                           GOAL_E2E_FRACTION))
        out += [{"goal": goal, "batch": batch, "value": value, "met": None if value is None else value >= bound}
                for goal, value, bound in checks]
    return out


def header(s: Settings, params: int, data: dict[str, Any] | None) -> list[str]:
    model = (f"DeepLabV3+ {s.backbone} {params / 1e6:.2f}M parameters, output stride {s.output_stride}, ASPP "
             f"{s.aspp} / decoder {s.decoder} channels, {NUM_CLASSES} classes, {s.size}x{s.size}")
    mode = (("bf16 autocast" if s.cuda else "fp32") + (", channels_last, " if s.channels_last else ", NCHW, ")
            + ("torch.compile" if s.compile else "eager") + f", step mode {s.step_mode}"
            + (" (both loops)" if s.step_mode == "graphed" else " (hpctrain)"))
    if s.cuda:
        mode += f", cudnn.benchmark {'on' if s.cudnn_benchmark else 'off'}"
    lines = [title_line(f"Face parsing throughput ({EXPERIMENT})", s.name, s.cuda),
             f"# {model}; {mode}; SGD (Nesterov momentum 0.9); one process, batch = global batch; {s.steps} steps x "
             f"{s.repeats} repeats after {s.warmup} warm-up; median [min, max]",
             f"# model-only: {s.samples:,} generated uint8 images + label maps on the device, no augmentation; "
             "plain/hpctrain windows alternating"]
    if data is not None:
        workers = data.get("workers")
        epoch = ", ".join(f"{data['train_samples'] // b} at batch {b}" for b in s.batches)
        lines.append(f"# end-to-end: {data['faces']:,} generated faces (hpctrain.datasets.faces) sharded at --resize "
                     f"{s.size}: {data['train_samples']:,} training samples, {data['train_bytes'] / 1e6:.1f} MB; "
                     f"{workers} loader worker(s), crop + flip augmentation; a path's windows back to back, its "
                     f"loader going on across them and starting afresh each epoch (steps per epoch: {epoch})")
    if s.smoke:
        lines.insert(0, f"# {'CPU ' if not s.cuda else ''}SMOKE TEST: a small model, "
                        f"{'fp32' if not s.cuda else 'bf16'}, a handful of steps; these numbers say nothing about "
                        "GPU throughput at the reference configuration")
    if data is not None and "gpu" in s.e2e and s.step_mode == "graphed":
        lines.append(f"# e2e gpu-decode runs step mode {step_mode_for(s, 'gpu')}: its batches hold JPEG bytes, which a "
                     "CUDA graph cannot take")
    if data is not None and "gpu" in s.e2e and not s.cuda:
        lines.append("# e2e gpu-decode without CUDA: torchvision decodes the JPEGs on the CPU (the path runs; its "
                     "speed means nothing)")
    return lines


def _vs(r: dict[str, Any]) -> str:
    return "reference" if r["vs"] is None else f"{r['vs']:.3f} of {r['vs_what']}"


def render(s: Settings, head: list[str], table: list[dict[str, Any]], goal_rows: list[dict[str, Any]]) -> str:
    peak = dense_peak(s.name) if s.cuda else None
    if peak is not None and peak.dtype == s.precision:
        peak_text = f"of the {peak.gpu}'s dense bf16 peak, {peak.tflops:g} TFLOP/s (hpctrain.perf.peaks)"
    elif peak is not None:
        peak_text = f"not compared: the table's peak for the {peak.gpu} is {peak.dtype}, the runs are {s.precision}"
    else:
        peak_text = "no dense peak known for this device" if s.cuda else "no peak on a CPU"
    columns = "| loop, batch | images/s | ms/step | GFLOP/image | TFLOP/s | % peak | peak GiB | vs |"
    lines = head + ["", columns, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        frac = "-" if r["peak_fraction"] is None else f"{100 * r['peak_fraction']:.1f}%"
        fmt = ",.0f" if r["images_per_s_median"] >= 100 else ",.1f"
        lines.append(f"| {r['loop']}, batch {r['batch']} | {spread(r['images_per_s'], fmt)} | "
                     f"{r['ms_per_step_median']:.2f} | {r['gflop_per_image']:.2f} | {r['tflops_median']:.3g} | "
                     f"{frac} | {gib(r['peak_memory_bytes'])} | {_vs(r)} |")
    lines += ["", f"% peak: {peak_text}. GFLOP/image: FlopCounterMode, forward + backward "
                  f"({REFERENCE_GFLOP:g} at the reference configuration).", ""]
    batches = sorted({g["batch"] for g in goal_rows})
    if s.reference:
        note = f"on {s.name}; the goals are stated for one H100"
    else:
        note = "not the reference configuration on a GPU: for the record only"
    lines += [f"Goals (one H100, reference configuration; {note}):", "",
              "| goal | " + " | ".join(f"batch {b}" for b in batches) + " |",
              "|---|" + "---:|" * len(batches)]
    for goal in dict.fromkeys(g["goal"] for g in goal_rows):
        cells = []
        for b in batches:
            g = next((x for x in goal_rows if x["goal"] == goal and x["batch"] == b), None)
            if g is None or g["value"] is None:
                cells.append("-")
            else:
                value = f"{g['value']:,.0f}" if g["value"] >= 100 else f"{g['value']:.3f}"
                cells.append(f"{'met' if g['met'] else 'missed'}: {value}")
        lines.append(f"| {goal} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---- main ----------------------------------------------------------------------------------------------------

def settings(args: argparse.Namespace) -> Settings:
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    smoke = bool(args.smoke) or not cuda
    model = dict(SMOKE if smoke else REFERENCE)
    for key in model:
        if getattr(args, key) is not None:
            model[key] = getattr(args, key)
    batches = tuple(args.batches) if args.batches else ((16, 32) if not smoke else ((8,) if cuda else (4,)))
    if not batches or min(batches) < 1:
        raise SystemExit(f"--batches {args.batches}: give positive batch sizes, e.g. 16 32")
    steps, warmup, repeats = windows(args, (50, 10, 5) if not smoke else ((5, 2, 2) if cuda else (2, 1, 2)))
    samples = args.samples if args.samples is not None else (2048 if not smoke else 4 * max(batches))
    if samples < max(batches):
        raise SystemExit(f"--samples {samples} is fewer than the largest batch, {max(batches)}")
    e2e = tuple(dict.fromkeys(p.strip() for p in args.e2e.split(",") if p.strip())) if args.e2e is not None \
        else (("cpu", "gpu") if cuda else ("cpu",))
    if e2e == ("none",):
        e2e = ()
    if any(p not in E2E for p in e2e):
        raise SystemExit(f"--e2e {args.e2e!r}: a comma-separated list of {', '.join(E2E)}, or none")
    faces = args.faces if args.faces is not None else (5000 if not smoke else 10 * max(batches))
    if e2e and math.floor(0.8 * faces) < max(batches):  # the standard split trains on 80%
        raise SystemExit(f"--faces {faces}: the training split (80%) must hold at least one batch of {max(batches)}")
    workers = args.workers if args.workers is not None else (-1 if cuda else 0)
    if model["size"] < 32 or model["output_stride"] not in (8, 16):
        raise SystemExit("--size must be at least 32 and --output-stride 8 or 16")
    return Settings(device, batches, steps, warmup, repeats, bool(args.compile), model["backbone"], model["size"],
                    model["output_stride"], model["aspp"], model["decoder"], samples, e2e, faces, workers, smoke,
                    bool(args.cudnn_benchmark) and cuda, args.workdir, _step_mode(args, cuda), bool(args.channels_last),
                    device_name(device))


def _step_mode(args: argparse.Namespace, cuda: bool) -> str:
    if args.step_mode == "graphed" and not cuda:
        raise SystemExit("--step-mode graphed needs a CUDA device (CUDA graphs)")
    if args.step_mode == "eager" and args.compile:
        return "compiled"  # train.compile=true with train.step_mode=eager is refused as a contradiction
    return args.step_mode


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_argument(p)
    p.add_argument("--batches", type=int, nargs="+", default=None, metavar="B",
                   help="batch sizes per GPU (default 16 32 on CUDA, 4 for the CPU smoke test)")
    add_window_arguments(p, cpu_steps=2)
    p.add_argument("--smoke", action="store_true", help="the small smoke-test model and sizes, also on CUDA")
    p.add_argument("--backbone", choices=("resnet18", "resnet34", "resnet50", "resnet101"), default=None,
                   help="default resnet101 (resnet18 for the smoke test)")
    p.add_argument("--size", type=int, default=None, help="image side (default 256; 64 for the smoke test)")
    p.add_argument("--output-stride", dest="output_stride", type=int, choices=(8, 16), default=None,
                   help="backbone output stride (default 16)")
    p.add_argument("--aspp", type=int, default=None, help="ASPP channels (default 256; 32 for the smoke test)")
    p.add_argument("--decoder", type=int, default=None, help="decoder channels (default 256; 32 for the smoke test)")
    p.add_argument("--samples", type=int, default=None,
                   help="generated images on the device for the model-only loops (default 2048)")
    p.add_argument("--e2e", default=None, metavar="PATHS",
                   help="end-to-end paths: cpu (loader decode), gpu (model.gpu_decode=true, nvJPEG), comma-separated, "
                        "or none (default cpu,gpu on CUDA, cpu without)")
    p.add_argument("--faces", type=int, default=None,
                   help="generated faces for the end-to-end rows, 80%% of them for training (default 5000; 40 for "
                        "the CPU smoke test)")
    p.add_argument("--workers", type=int, default=None,
                   help="data.num_workers for the end-to-end rows (default -1: hpctrain's choice; 0 on CPU)")
    p.add_argument("--workdir", default="", metavar="DIR",
                   help="keep the generated, sharded faces here and reuse them (default: a temporary folder)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile the model in every loop (train.compile for hpctrain); compilation falls in "
                        "the warm-up (default: eager)")
    p.add_argument("--cudnn-benchmark", dest="cudnn_benchmark", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.backends.cudnn.benchmark for every loop (default off, as hpctrain runs)")
    p.add_argument("--channels-last", dest="channels_last", action=argparse.BooleanOptionalAction, default=True,
                   help="channels_last memory format in both loops (default on, as the experiment runs on GPUs)")
    p.add_argument("--step-mode", dest="step_mode", choices=("eager", "graphed"), default="eager",
                   help="hpctrain's train.step_mode in its rows (graphed: the whole step captured as a CUDA graph, "
                        "after its eager warm-up; with --compile the compiled model is captured); graphed also "
                        "captures the plain loop by hand, so the two compare the same technique (default eager)")
    p.add_argument("--json", default="", metavar="PATH", help="also write the numbers as JSON")
    p.add_argument("--prepare-only", action="store_true",
                   help="generate and shard the face set into --workdir and exit, e.g. on a CPU machine before a GPU "
                        "job without network: --prepare-only --faces 2000 --size 256 --workdir DIR (about 35 MB)")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    s = settings(args)
    if args.prepare_only:
        if not args.workdir:
            raise SystemExit("--prepare-only needs --workdir DIR: where the face set is kept for a later run")
        shards, data = prepare_shards(s, Path(args.workdir), log, all_cores=True)
        print(f"face set ready in {shards} ({data['faces']} faces at {data['size']} px, "
              f"{data['train_bytes'] / 1e6:.1f} MB of training shards); use --workdir {args.workdir}", flush=True)
        return {"prepared": data}

    cudnn_before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = s.cudnn_benchmark
    with contextlib.ExitStack() as stack:
        data = shards = None
        if s.e2e:  # before anything is timed (and before CUDA is touched: the face generators are processes)
            workdir = Path(s.workdir) if s.workdir else Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="hpctrain-faceseg-faces-")))
            workdir.mkdir(parents=True, exist_ok=True)
            shards, data = prepare_shards(s, workdir, log)
        results, params, starts = [], 0, {}
        try:
            for batch in s.batches:
                measured, flops, params = measure_model_only(s, batch, log)
                for path in s.e2e:
                    measured[E2E[path]], starts[f"{E2E[path]}, batch {batch}"] = measure_e2e(s, batch, path, shards,
                                                                                             log)
                results.append((measured, flops))
        finally:
            torch.backends.cudnn.benchmark = cudnn_before
    if data is not None:
        data = {**data, "workers": _workers(s), "loader_starts": starts}
    table = rows(s, results)
    goal_rows = goals(table)
    head = header(s, params, data)
    print(render(s, head, table, goal_rows), end="", flush=True)
    report = {"header": head, **report_environment(s.name, s.cuda), "smoke": s.smoke, "reference": s.reference,
              "compile": s.compile, "cudnn_benchmark": s.cudnn_benchmark, "precision": s.precision,
              "model": {"backbone": s.backbone, "size": s.size, "output_stride": s.output_stride, "aspp": s.aspp,
                        "decoder": s.decoder, "parameters": params},
              "samples": s.samples, "data": data,
              "peak": peak_of(s.name, s.cuda), "rows": table, "goals": goal_rows}
    write_json(args.json, report)
    return report


def _workers(s: Settings) -> int:
    """The loader workers the end-to-end rows had (hpctrain's choice for -1)."""
    if s.workers >= 0:
        return s.workers
    from hpctrain.data.loader import auto_workers
    from hpctrain.dist.runtime import single_process_runtime

    return auto_workers(single_process_runtime(s.device))


if __name__ == "__main__":
    main()
