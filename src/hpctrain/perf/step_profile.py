"""One device's measured step for `hpctrain plan` (commands/plan.py): forward, backward and optimizer times with
the run's own config and code path (hpctrain's context, loader, precision, optimizer and EMA), one process, on
this machine's device. The estimate from it is perf/plan.py's arithmetic.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch

from hpctrain.config.schema import RunConfig
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.perf.plan import StepProfile


def measure_step(experiment_cls, cfg: RunConfig, steps: int) -> tuple[StepProfile, torch.device]:
    """Median forward, backward and optimizer times of this config's micro-batch on one device (an eager step)."""
    from hpctrain.train.memory_format import resolve_memory_format
    from hpctrain.train.run import build_context

    runtime = single_process_runtime()
    cfg, _ = resolve_memory_format(cfg, runtime, experiment_cls(cfg), "eager")
    ctx = build_context(cfg, runtime, experiment_cls(cfg), config_text="", write_run_dir=False, pretrained=False)
    batches = _endless(ctx)
    # two warm-up steps: allocator, autotuning, lazy optimizer state
    times = [_timed_step(ctx, next(batches)) for _ in range(steps + 2)]
    fwd, bwd, opt = (statistics.median(t[k] for t in times[2:]) for k in range(3))
    grad_bytes = sum(p.numel() * p.element_size() for p in ctx.raw_model.parameters() if p.requires_grad)
    return StepProfile(fwd, bwd, opt, grad_bytes, cfg.train.micro_batch_size), runtime.device


def _endless(ctx):
    """Micro-batches from the run's own loader, epoch after epoch (a tiny data set may end first)."""
    for epoch in itertools.count():
        ctx.sampler.set_position(epoch, 0)
        yield from ctx.train_loader


def _timed_step(ctx, host_batch) -> tuple[float, float, float]:
    from hpctrain.experiments.base import BatchInfo, call_train_loss
    from hpctrain.train.device import to_device
    from hpctrain.train.step import apply_gradients

    device = ctx.runtime.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    batch = to_device(host_batch, device, ctx.cfg.train.channels_last_on)
    sync()
    t0 = time.perf_counter()
    with ctx.precision.autocast():
        # One process measuring one micro-batch: the first position of the step's global batch.
        info = BatchInfo("train", ctx.state.step, 0, ctx.batches.global_batch_size, ctx.cfg.run.seed)
        loss = call_train_loss(ctx.experiment, ctx.model, batch, info)
    sync()
    t1 = time.perf_counter()
    ctx.scaler.scale(loss).backward()
    sync()
    t2 = time.perf_counter()
    apply_gradients(ctx)
    sync()
    return t1 - t0, t2 - t1, time.perf_counter() - t2
