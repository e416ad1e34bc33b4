"""DDPM reference experiment (ddpm_cifar10): training throughput per GPU, hpctrain's loop against a plain torch
loop on the same model, in one process and one run. Prints a table.

    python benchmarks/ddpm_throughput.py [--device auto|cuda|cpu] [--micro 64,128] [--steps 50] [--warmup 10]
                                         [--repeats 5] [--modes eager,graphed] [--compile] [--json PATH]

For each step mode (--modes: eager, compiled, graphed, graphed-compiled) and micro batch (= the global batch: one
process), two loops train the U-Net of Ho et al. with the same technique: "plain", a hand-written torch loop (for a
graphed mode captured by hand), and "hpctrain", hpctrain's own loop on its ddpm_cifar10 context with nothing turned
off but validation, logging and checkpoints. Both are warmed up (compilation falls there), then timed in --repeats
windows of --steps steps, alternating, synchronised only at a window's ends; medians [min, max]. Columns: images/s,
ms/step, host ms (enqueue time), GFLOP/image (FlopCounterMode), TFLOP/s, % of the dense bf16 peak, peak GiB,
hpctrain vs plain. A second table prices drawing per-sample noise by position (hpctrain.data.positional).

Without CUDA (or with --device cpu) this is a smoke test (a tiny U-Net, fp32): its numbers say nothing about a GPU.
benchmarks/throughput.md gives the method and each column in full; the harness is throughput_common.py.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.flop_counter import FlopCounterMode

from hpctrain.config.schema import RunConfig
from hpctrain.experiments.base import BatchInfo
from hpctrain.experiments.ddpm.diffusion import GaussianDiffusion
from hpctrain.perf.peaks import dense_peak
from hpctrain.train.ema import EMA

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is no package: the shared helpers beside us
from throughput_common import (HpctrainLoop, ReplayedPlain, add_device_argument, alternate_windows,  # noqa: E402
                               add_window_arguments, allocated, device_name, gib, log, paired_ratio, peak_fraction,
                               peak_of, quiet_run_overrides, release, report_environment, resolve_device, spread, sync,
                               title_line, warm_libraries, window_rates, windows, write_json)

EXPERIMENT = "ddpm_cifar10"
GPU_SAMPLES = 50_000
"""Generated training images on the GPU: CIFAR-10's training-set size (150 MB of uint8)."""
CPU_SAMPLES = 256
CPU_MODEL = ("model.image_size=16", "model.ch=16", "model.ch_mult=[1, 2]", "model.num_res_blocks=1",
             "model.attn_resolutions=[8]", "model.norm_groups=8")
"""The smoke test's tiny U-Net (0.18M parameters)."""
DRAW_GLOBAL, DRAW_MICRO = 384, 64
"""The reference run's global batch and micro batch per GPU, for the positional-draw price."""
LOOPS = ("plain", "hpctrain")
MODES = ("eager", "compiled", "graphed", "graphed-compiled")


@dataclass(frozen=True)
class Settings:
    device: torch.device
    micros: tuple[int, ...]
    steps: int
    warmup: int
    repeats: int
    modes: tuple[str, ...]
    draw_iters: int
    channels_last: bool = True
    """channels_last memory format in both loops (train.channels_last for hpctrain)."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def smoke(self) -> bool:
        return not self.cuda


@dataclass
class Measured:
    """One loop at one micro batch."""

    loop: str
    micro: int
    mode: str = "eager"
    seconds: list[float] = field(default_factory=list)
    """Each timed window's wall time."""
    enqueue_seconds: list[float] = field(default_factory=list)
    """Each timed window's time until the host had enqueued its last step."""
    resident_bytes: int = 0
    transient_bytes: int = 0


# ---- configuration ------------------------------------------------------------------------------------------

def overrides(s: Settings, micro: int, run_dir: str, mode: str = "eager") -> list[str]:
    """hpctrain's config for one micro batch: the micro batch is the global batch (one process, accumulation 1)."""
    samples = GPU_SAMPLES if s.cuda else CPU_SAMPLES
    step_mode = mode.split("-")[0]
    out = [
        "model.source=fixture", f"model.fixture_samples={samples}",
        "data.on_device=true", "data.num_workers=0",
        f"train.precision={'bf16' if s.cuda else 'fp32'}",
        f"train.channels_last={'true' if s.channels_last else 'false'}",
        "train.cudnn_benchmark=off",  # as the plain loop runs (hpctrain's auto turns it on for a graphed step)
        f"train.step_mode={step_mode}", f"train.compile={'true' if mode == 'graphed-compiled' else 'false'}",
        *quiet_run_overrides(micro, run_dir),
    ]
    return out + (list(CPU_MODEL) if s.smoke else [])


def load(s: Settings, micro: int, run_dir: str, mode: str = "eager"):
    from hpctrain.resolution import resolve_config as resolve

    return resolve(EXPERIMENT, None, tuple(overrides(s, micro, run_dir, mode)))


# ---- the two loops -------------------------------------------------------------------------------------------

class PlainLoop:
    """What one would write by hand for the reference run on one GPU."""

    def __init__(self, experiment, cfg: RunConfig, device: torch.device, compile_model: bool) -> None:
        o, t, opt = cfg.model, cfg.train, cfg.optim
        self.device, self.micro, self.clip, self.flip = device, t.micro_batch_size, t.grad_clip, o.flip
        self.channels_last = t.channels_last
        self.autocast_cache = True  # off when graphed: no cached casts made during capture (and no recompile)
        self.dtype = torch.bfloat16 if t.precision == "bf16" else None
        torch.manual_seed(cfg.run.seed)
        raw = experiment.build_model().to(device)
        self.raw = raw.to(memory_format=torch.channels_last) if self.channels_last else raw
        self.model = torch.compile(self.raw) if compile_model else self.raw
        self.optimizer = torch.optim.AdamW(self.raw.parameters(), lr=opt.lr, betas=opt.betas,
                                           weight_decay=opt.weight_decay, fused=device.type == "cuda" or None)
        warm = max(opt.warmup_steps, 1)
        self.scheduler = LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / warm))
        # The EMA hpctrain uses (torch's AveragedModel arithmetic without its per-step host-to-device counter
        # copy): the same EMA work on both sides, so the ratio is the loop's overhead, not the EMA's.
        self.ema = EMA(self.raw, opt.ema_decay) if opt.ema_decay > 0 else None
        self.diffusion = GaussianDiffusion(o.timesteps, o.beta_start, o.beta_end, o.variance)
        self.timesteps = o.timesteps
        n = o.fixture_samples
        self.images = torch.randint(0, 256, (n, o.channels, o.image_size, o.image_size), dtype=torch.uint8,
                                    device=device)
        self.order, self.at = torch.empty(0, dtype=torch.long), n  # a new epoch at the first step

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=self.autocast_cache)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m, n = self.micro, len(self.images)
        if self.at + m > n:
            self.order, self.at = torch.randperm(n, device=self.device), 0
        x = self.images[self.order[self.at : self.at + m]]
        self.at += m
        if self.flip:
            x = torch.where(torch.rand(m, 1, 1, 1, device=self.device) < 0.5, x.flip(-1), x)
        x0 = x.float().div_(127.5).sub_(1.0)
        if self.channels_last:
            x0 = x0.contiguous(memory_format=torch.channels_last)
        t = torch.randint(self.timesteps, (m,), device=self.device)
        noise = torch.randn(m, *x0.shape[1:], device=self.device)
        return x0, t, noise

    def step(self) -> None:
        x0, t, noise = self.batch()
        with self.autocast():
            loss = self.diffusion.training_losses(self.model, x0, t, noise).mean()
        loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.raw.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update_parameters(self.raw)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def warm(self, steps: int) -> None:
        self.run(steps)

    def flops_per_step(self) -> int:
        """Forward + backward of one training step on the uncompiled model (the optimizer's elementwise work is
        not counted: FlopCounterMode counts matrix multiplies, convolutions and attention)."""
        x0, t, noise = self.batch()
        with FlopCounterMode(display=False) as counter:
            with self.autocast():
                loss = self.diffusion.training_losses(self.raw, x0, t, noise).mean()
            loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
        return counter.get_total_flops()


class PlainGraphed(ReplayedPlain):
    """The plain loop's step captured by hand (throughput_common.ReplayedPlain): forward, backward, clipping, fused
    AdamW, EMA."""

    def __init__(self, plain: PlainLoop) -> None:
        from hpctrain.train.ema import ema_update

        super().__init__(plain)
        plain.autocast_cache = False
        self._ema_update = ema_update
        # made here: a host-to-device copy during the capture would break it
        self.weight = torch.tensor(1.0 - plain.ema.decay, device=plain.device) if plain.ema is not None else None

    def record(self, static: list[torch.Tensor]) -> None:
        p = self.plain
        with p.autocast():
            loss = p.diffusion.training_losses(p.model, *static).mean()
        loss.backward()
        if p.clip > 0:
            torch.nn.utils.clip_grad_norm_(p.raw.parameters(), p.clip, foreach=True)
        p.optimizer.step()
        if self.weight is not None:
            self._ema_update(p.ema, p.raw, self.weight)

    def flops_per_step(self) -> int:
        return self.plain.flops_per_step()


def plain_loop(experiment, cfg: RunConfig, device: torch.device, mode: str):
    plain = PlainLoop(experiment, cfg, device, compile_model=mode.endswith("compiled"))
    return PlainGraphed(plain) if mode.startswith("graphed") else plain


# ---- measuring -----------------------------------------------------------------------------------------------

def measure_micro(s: Settings, micro: int, mode: str,
                  log: Callable[[str], None]) -> tuple[dict[str, Measured], int, int]:
    """Both loops at one micro batch in one step mode; returns (measured, FLOP per step, parameters)."""
    measured = {name: Measured(name, micro, mode) for name in LOOPS}
    with tempfile.TemporaryDirectory(prefix="hpctrain-ddpm-bench-") as run_dir:
        cls, cfg = load(s, micro, run_dir, mode)
        warm_libraries(s.device)
        start = allocated(s.device)
        plain = plain_loop(cls(cfg), cfg, s.device, mode)
        params = sum(p.numel() for p in plain.raw.parameters())
        flops = plain.flops_per_step()
        plain.warm(s.warmup)
        after_plain = allocated(s.device)
        hpc = HpctrainLoop(cls(cfg), cfg, s.device)
        if mode.startswith("graphed") and getattr(hpc.ctx.stepper, "mode", "") != "graphed":
            raise RuntimeError(f"hpctrain chose step mode {hpc.ctx.step_choice} for --modes {mode}")
        hpc.warm(s.warmup)
        after_hpc = allocated(s.device)
        measured["plain"].resident_bytes = after_plain - start
        measured["hpctrain"].resident_bytes = after_hpc - after_plain
        loops = {"plain": plain.run, "hpctrain": hpc.run}
        alternate_windows(loops, measured, micro, s.steps, s.repeats, s.device, log, f"{mode}, micro {micro}")
        del plain, hpc, loops
    release(s.device, mode.endswith("compiled"))
    return measured, flops, params


def measure_draws(s: Settings, image_shape: tuple[int, ...], timesteps: int,
                  log: Callable[[str], None]) -> dict[str, list[float]]:
    """Microseconds per step of the timestep + noise draws: positional (DRAW_MICRO positions at each of the
    global batch's micro positions in turn) against torch's of DRAW_MICRO."""
    device, iters, ranks = s.device, s.draw_iters, DRAW_GLOBAL // DRAW_MICRO

    def positional(n: int) -> None:
        for i in range(n):
            info = BatchInfo("train", i, (i % ranks) * DRAW_MICRO, DRAW_GLOBAL, 0)
            info.randint(timesteps, DRAW_MICRO, stream=0, device=device)
            info.randn(DRAW_MICRO, *image_shape, stream=1, device=device)

    def plain(n: int) -> None:
        for _ in range(n):
            torch.randint(timesteps, (DRAW_MICRO,), device=device)
            torch.randn(DRAW_MICRO, *image_shape, device=device)

    draws = {"positional": positional, "plain": plain}
    times: dict[str, list[float]] = {name: [] for name in draws}
    for fn in draws.values():
        fn(max(iters // 10, 2))  # warm-up: generators, kernels, allocator
    names = list(draws)
    for r in range(max(s.repeats, 3)):
        for name in names if r % 2 == 0 else names[::-1]:
            sync(device)
            started = time.perf_counter()
            draws[name](iters)
            sync(device)
            times[name].append((time.perf_counter() - started) / iters * 1e6)
    log(f"  draws: positional {statistics.median(times['positional']):.1f} us/step, "
        f"plain {statistics.median(times['plain']):.1f} us/step")
    return times


# ---- reporting -----------------------------------------------------------------------------------------------

def rows(s: Settings, results: list[tuple[dict[str, Measured], int]]) -> list[dict[str, Any]]:
    """One row per loop and micro batch, as plain numbers (the JSON and the table)."""
    peak = dense_peak(device_name(s.device)) if s.cuda else None
    out = []
    for measured, flops in results:
        plain_rates = window_rates(measured["plain"].micro, measured["plain"].seconds, s.steps)
        for name in LOOPS:
            m = measured[name]
            rates = window_rates(m.micro, m.seconds, s.steps)
            per_image = flops / m.micro
            tflops = [per_image * r / 1e12 for r in rates]
            fraction = peak_fraction(statistics.median(tflops), peak, "bf16")
            out.append({
                "loop": name, "mode": m.mode, "micro": m.micro, "steps": s.steps, "repeats": s.repeats,
                "window_s": m.seconds, "images_per_s": rates, "images_per_s_median": statistics.median(rates),
                "ms_per_step_median": 1e3 * statistics.median(m.seconds) / s.steps,
                "host_ms_per_step_median": 1e3 * statistics.median(m.enqueue_seconds) / s.steps,
                "flop_per_step": flops, "gflop_per_image": per_image / 1e9,
                "tflops_median": statistics.median(tflops),
                "peak_fraction": fraction,
                "peak_memory_bytes": m.resident_bytes + m.transient_bytes if s.cuda else None,
                "resident_bytes": m.resident_bytes if s.cuda else None,
                "vs_plain": paired_ratio(rates, plain_rates),
            })
    return out


def draw_summary(times: dict[str, list[float]], table: list[dict[str, Any]]) -> dict[str, Any]:
    pos, plain = statistics.median(times["positional"]), statistics.median(times["plain"])
    ref = [r for r in table if r["loop"] == "hpctrain" and r["mode"] == table[0]["mode"]]
    ref = [r for r in ref if r["micro"] == DRAW_MICRO] or ref
    step_us = 1e3 * ref[0]["ms_per_step_median"] if ref else None
    return {"global": DRAW_GLOBAL, "micro": DRAW_MICRO, "positional_us": times["positional"],
            "plain_us": times["plain"], "price_us": pos - plain,
            "price_fraction_of_step": (pos - plain) / step_us if step_us else None,
            "step_micro": ref[0]["micro"] if ref else None}


def header(s: Settings, params: int, cfg: RunConfig) -> list[str]:
    o = cfg.model
    model = (f"U-Net {params / 1e6:.2f}M parameters (ch {o.ch}, ch_mult {tuple(o.ch_mult)}, "
             f"{o.num_res_blocks} res blocks, {o.image_size}x{o.image_size}, dropout {o.dropout:g})")
    mode = (("bf16 autocast" if s.cuda else "fp32") + (", channels_last" if s.channels_last else ", NCHW")
            + ", modes " + ", ".join(s.modes))
    lines = [title_line(f"DDPM throughput ({EXPERIMENT})", device_name(s.device), s.cuda),
             f"# {model}; {mode}; one process, micro batch = global batch; {s.steps} steps x {s.repeats} "
             f"repeats after {s.warmup} warm-up, plain/hpctrain alternating; median [min, max]"]
    if s.smoke:
        lines.insert(0, "# CPU SMOKE TEST: a tiny model, fp32, a handful of steps; these numbers "
                        "say nothing about GPU throughput")
    return lines


def render(s: Settings, head: list[str], table: list[dict[str, Any]], draws: dict[str, Any]) -> str:
    peak = dense_peak(device_name(s.device)) if s.cuda else None
    if peak is not None and peak.dtype == "bf16":
        peak_text = f"of the {peak.gpu}'s dense bf16 peak, {peak.tflops:g} TFLOP/s (hpctrain.perf.peaks)"
    elif peak is not None:
        peak_text = f"not compared: the table's peak for the {peak.gpu} is {peak.dtype}, the runs are bf16"
    else:
        peak_text = "no dense peak known for this device" if s.cuda else "no peak on a CPU"
    columns = ("| loop, mode, micro batch | images/s | ms/step | host ms | GFLOP/image | TFLOP/s | % peak | peak GiB "
               "| vs plain |")
    lines = head + ["", columns, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        frac = "-" if r["peak_fraction"] is None else f"{100 * r['peak_fraction']:.1f}%"
        fmt = ",.0f" if r["images_per_s_median"] >= 100 else ",.1f"
        lines.append(f"| {r['loop']}, {r['mode']}, micro {r['micro']} | {spread(r['images_per_s'], fmt)} | "
                     f"{r['ms_per_step_median']:.2f} | {r['host_ms_per_step_median']:.2f} | "
                     f"{r['gflop_per_image']:.2f} | {r['tflops_median']:.3g} | "
                     f"{frac} | {gib(r['peak_memory_bytes'])} | {r['vs_plain']:.3f} |")
    lines += ["", f"% peak: {peak_text}. GFLOP/image: FlopCounterMode, forward + backward.", ""]
    share = draws["price_fraction_of_step"]
    share_text = f", {100 * share:.2f}% of hpctrain's step at micro {draws['step_micro']}" if share is not None else ""
    lines += ["| per-sample draws per step (timesteps + noise) | us/step | price |", "|---|---:|---:|",
              f"| positional: BatchInfo.randint + randn, {draws['micro']} of a global {draws['global']} | "
              f"{spread(draws['positional_us'], '.1f')} | {draws['price_us']:+.1f} us{share_text} |",
              f"| plain: torch.randint + torch.randn of {draws['micro']} | {spread(draws['plain_us'], '.1f')} | "
              "reference |"]
    return "\n".join(lines) + "\n"


# ---- main ----------------------------------------------------------------------------------------------------

def settings(args: argparse.Namespace) -> Settings:
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    micros = tuple(int(m) for m in args.micro.split(",") if m.strip()) if args.micro else ((64, 128) if cuda else (8,))
    if not micros or min(micros) < 1:
        raise SystemExit(f"--micro {args.micro!r}: give positive micro batch sizes, e.g. 64,128")
    steps, warmup, repeats = windows(args, (50, 10, 5) if cuda else (3, 1, 2))
    if args.modes:
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    else:
        modes = ("compiled",) if args.compile else ("eager", "graphed") if cuda else ("eager",)
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise SystemExit(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    if not cuda and any(m.startswith("graphed") for m in modes):
        raise SystemExit("--modes graphed needs a CUDA device (CUDA graphs); on the CPU: --modes eager,compiled")
    return Settings(device, micros, steps, warmup, repeats, modes, 200 if cuda else 10, bool(args.channels_last))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_argument(p)
    p.add_argument("--micro", default="", metavar="M,...", help="micro batch sizes (default 64,128 on CUDA, 8 on CPU)")
    add_window_arguments(p, cpu_steps=3)
    p.add_argument("--modes", default="", metavar="MODE,...",
                   help=f"step modes, each a row pair ({', '.join(MODES)}; default eager,graphed on CUDA, eager on "
                        "the CPU); compilation and capture fall in the warm-up")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="without --modes: --modes compiled (kept for older command lines)")
    p.add_argument("--channels-last", dest="channels_last", action=argparse.BooleanOptionalAction, default=True,
                   help="channels_last memory format in both loops (default on; --no-channels-last measures NCHW, "
                        "where GroupNorm needs no layout conversions)")
    p.add_argument("--json", default="", metavar="PATH", help="also write the numbers as JSON")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    s = settings(args)
    results, params, cfg = [], 0, None
    for mode in s.modes:
        for micro in s.micros:
            measured, flops, params = measure_micro(s, micro, mode, log)
            results.append((measured, flops))
    with tempfile.TemporaryDirectory() as run_dir:
        _, cfg = load(s, s.micros[0], run_dir)
    o = cfg.model
    table = rows(s, results)
    draws = draw_summary(measure_draws(s, (o.channels, o.image_size, o.image_size), o.timesteps, log), table)
    head = header(s, params, cfg)
    print(render(s, head, table, draws), end="", flush=True)
    name = device_name(s.device)
    report = {"header": head, **report_environment(name, s.cuda), "smoke": s.smoke, "modes": list(s.modes),
              "parameters": params, "peak": peak_of(name, s.cuda), "rows": table, "draws": draws}
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
