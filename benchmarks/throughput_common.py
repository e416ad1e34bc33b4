"""The one throughput harness ddpm_throughput.py and faceseg_throughput.py share: the device and the timing
flags, hpctrain's quiet one-process config, hpctrain's loop driven window by window in this process, timed windows
with their memory, the table's small formatters and the JSON report's common fields. Each script keeps only what is
its experiment's own: its model and data set-up, its plain loop and its rows.
benchmarks/ is not a package: the scripts put their own folder on sys.path to import this."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from hpctrain.config.schema import RunConfig
from hpctrain.perf.peaks import dense_peak
from hpctrain.provenance import source_commit

ROOT = Path(__file__).resolve().parent.parent
HUGE = 10**9
"""Steps that are never reached: eval.every_steps, log.every_steps, train.max_steps."""


# ---- command line -------------------------------------------------------------------------------------------

def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA when there is a device, else the CPU smoke test")


def add_window_arguments(p: argparse.ArgumentParser, cpu_steps: int) -> None:
    """--steps, --warmup, --repeats: how long each loop is timed (defaults by device, resolved in windows())."""
    p.add_argument("--steps", type=int, default=None,
                   help=f"steps per timed window (default 50 on CUDA, {cpu_steps} on CPU)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per loop (default 10 on CUDA, 1 on CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed windows per loop (default 5 on CUDA, 2 on CPU)")


def resolve_device(choice: str) -> torch.device:
    """--device: auto is CUDA when there is a device; a CUDA device always has its index."""
    if choice == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif choice == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def windows(args: argparse.Namespace, defaults: tuple[int, int, int]) -> tuple[int, int, int]:
    """(steps, warmup, repeats) from the flags, else ``defaults``; each at least 1."""
    steps, warmup, repeats = (given if given is not None else default
                              for given, default in zip((args.steps, args.warmup, args.repeats), defaults))
    if steps < 1 or warmup < 1 or repeats < 1:
        raise SystemExit("--steps, --warmup and --repeats must be at least 1")
    return steps, warmup, repeats


def log(line: str) -> None:
    """Progress to stderr: stdout holds the table alone."""
    print(line, file=sys.stderr, flush=True)


# ---- hpctrain's config --------------------------------------------------------------------------------------

def quiet_run_overrides(batch: int, run_dir: str) -> list[str]:
    """One process at ``batch`` (global = micro, no accumulation) that never stops, validates, logs or saves on
    its own: the harness drives its steps."""
    return [
        f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}", f"train.max_steps={HUGE}",
        f"eval.every_steps={HUGE}", f"log.every_steps={HUGE}", "log.outputs_every_steps=0",
        "log.outputs_every_epochs=0", "log.progress=off", "log.tensorboard=false", "log.plots=false",
        "ckpt.every_steps=0", "ckpt.every_minutes=0", f"run.dir={run_dir}",
    ]


def log_window(log: Callable[[str], None], what: str, name: str, batch: int, r: int, seconds: float,
               steps: int) -> None:
    """One timed window's progress line; ``what`` names the row's settings, e.g. 'batch 16'."""
    log(f"  {what}, repeat {r + 1}: {name} {1e3 * seconds / steps:.2f} ms/step, "
        f"{batch * steps / seconds:,.1f} images/s")


def alternate_windows(loops: dict[str, Callable[[int], None]], measured: dict[str, Any], batch: int, steps: int,
                      repeats: int, device: torch.device, log: Callable[[str], None], what: str) -> None:
    """``repeats`` timed windows of ``steps`` steps per loop, the loops alternating (the first one first in even
    repeats, the other in odd ones) so that machine noise hits both; each window's time into ``measured[name]``."""
    names = tuple(loops)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            timed_window(loops[name], steps, device, measured[name])
            log_window(log, what, name, batch, r, measured[name].seconds[-1], steps)


# ---- the rows' arithmetic -----------------------------------------------------------------------------------

def window_rates(batch: int, seconds: list[float], steps: int) -> list[float]:
    """Images per second of each timed window of ``steps`` steps at ``batch``."""
    return [batch * steps / t for t in seconds]


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median of the per-repeat ratios a[i] / b[i] (windows that ran back to back)."""
    if not a or len(a) != len(b):
        raise ValueError(f"paired_ratio needs two lists of one length, got {len(a)} and {len(b)}")
    return statistics.median(x / y for x, y in zip(a, b))


def median_ratio(a: list[float], b: list[float]) -> float:
    """median(a) / median(b) (windows that did not run side by side)."""
    return statistics.median(a) / statistics.median(b)


def peak_fraction(tflops: float, peak: Any, precision: str) -> float | None:
    """tflops over the dense peak when the peak is of the precision measured, else None."""
    if peak is None or peak.dtype != precision or not peak.tflops:
        return None
    return tflops / peak.tflops


# ---- the report ---------------------------------------------------------------------------------------------

def title_line(title: str, name: str, cuda: bool) -> str:
    """The table's first line: what, on which device and torch, when, at which commit."""
    torch_text = f"torch {torch.__version__}" + (f" (CUDA {torch.version.cuda})" if cuda else "")
    return (f"# {title}: {name} | {torch_text} | "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | commit {source_commit(ROOT) or '-'}")


def report_environment(name: str, cuda: bool) -> dict[str, Any]:
    """The JSON report's fields every throughput benchmark has: device, torch, CUDA, date, commit."""
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": source_commit(ROOT) or "-"}


def peak_of(name: str, cuda: bool) -> dict[str, Any] | None:
    """The device's dense peak (hpctrain.perf.peaks) as the report stores it; None on the CPU or if unknown."""
    peak = dense_peak(name) if cuda else None
    return dataclasses.asdict(peak) if peak is not None else None


def write_json(path: str, report: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=1) + "\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class NoCheckpoint:
    """In place of hpctrain's Checkpointer: the loop saves when a launch ends, and each timed window is a launch."""

    def save(self, *args: Any, **kwargs: Any) -> None:
        pass


class HpctrainLoop:
    """hpctrain's context and loop, in this process: each run(n) is one call of hpctrain.train.loop.train that
    stops n steps on (train.stop_at_step)."""

    def __init__(self, experiment, cfg: RunConfig, device: torch.device) -> None:
        from hpctrain.dist.runtime import single_process_runtime
        from hpctrain.train.run import build_context

        self.ctx = build_context(cfg, single_process_runtime(device), experiment, config_text="", write_run_dir=False,
                                 pretrained=False)
        self.ctx.checkpointer = NoCheckpoint()

    def warm(self, steps: int) -> None:
        """``steps`` warm-up steps, and under train.step_mode=graphed as many more as the step needs to be captured
        (its eager warm-up, then the capture): the timed windows then only replay."""
        pending = getattr(self.ctx.stepper, "warmup_left", None)
        self.run(steps + (pending + 1 if pending is not None and self.ctx.stepper.graph is None else 0))

    def run(self, steps: int) -> None:
        from hpctrain.train import loop

        ctx = self.ctx
        stop = ctx.state.step + steps
        ctx.cfg = dataclasses.replace(ctx.cfg, train=dataclasses.replace(ctx.cfg.train, stop_at_step=stop))
        result = loop.train(ctx)
        if result.stop_signal or ctx.state.step != stop:
            raise RuntimeError(f"hpctrain's loop stopped at step {ctx.state.step}, not {stop} "
                               f"(stop signal {result.stop_signal})")


def allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    sync(device)
    return torch.cuda.memory_allocated(device)


def timed_window(run: Callable[[int], None], steps: int, device: torch.device, m: Any) -> None:
    """Time run(steps) to its last kernel into m.seconds; the peak memory above the start into m.transient_bytes."""
    base = allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    run(steps)
    enqueued = time.perf_counter()
    sync(device)
    m.seconds.append(time.perf_counter() - started)
    # The host's time to enqueue the window (to the GPU's end: seconds). Close to seconds: the host bounds the step,
    # or it waited for the GPU inside (a full launch queue, a synchronisation); far below: the GPU bounds it.
    if hasattr(m, "enqueue_seconds"):
        m.enqueue_seconds.append(enqueued - started)
    if device.type == "cuda":
        m.transient_bytes = max(m.transient_bytes, torch.cuda.max_memory_allocated(device) - base)


def warm_libraries(device: torch.device) -> None:
    """cuBLAS keeps a workspace per stream from its first call on: made here, it counts for neither loop."""
    if device.type == "cuda":
        a = torch.ones(16, 16, device=device)
        a @ a
        with torch.autocast("cuda", dtype=torch.bfloat16):
            a @ a
        sync(device)


def release(device: torch.device, compiled: bool) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if compiled:
        torch._dynamo.reset()  # a second batch size compiles afresh, not as a dynamic-shape recompile


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


class ReplayedPlain:
    """A benchmark's plain loop with its step captured by hand with torch.cuda.graph, as one would write it for one
    GPU: torch's recipe of eager warm-up steps on a side stream (library handles, optimizer state), each step's batch
    made outside the graph and copied into static slots, the scheduler moving a tensor learning rate in place.
    Subclasses give ``record(static)``: the work the graph captures. ``plain`` has batch(), run(steps), optimizer,
    scheduler, raw and device."""

    def __init__(self, plain: Any) -> None:
        self.plain, self.raw = plain, plain.raw
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: list[torch.Tensor] = []

    def record(self, static: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def warm(self, steps: int) -> None:
        p = self.plain
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            p.run(max(steps, 3))
        torch.cuda.current_stream().wait_stream(side)
        self.static = [t.clone() for t in p.batch()]
        # LambdaLR fills a tensor rate in place (torch >= 2.2), so the scheduler moves what the graph reads; one
        # tensor per group (each group's rate is its own).
        for group in p.optimizer.param_groups:
            group["lr"] = torch.tensor(float(group["lr"]), device=p.device)
            if "capturable" in group:
                group["capturable"] = True
        p.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.record(self.static)

    def step(self) -> None:
        for static, fresh in zip(self.static, self.plain.batch()):
            static.copy_(fresh)
        self.graph.replay()
        self.plain.scheduler.step()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()
