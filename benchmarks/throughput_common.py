"""What the throughput benchmarks (ddpm_throughput.py, faceseg_throughput.py) share: hpctrain's loop driven
window by window in this process, timed windows with their memory, and the table's small formatters.
benchmarks/ is not a package: the scripts put their own folder on sys.path to import this."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from typing import Any, Callable

import torch

from hpctrain.config.schema import RunConfig


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
