"""The one owner of the optimizer step as Python drives it (train.step_mode eager and compiled; compiled is the
model under torch.compile, chosen when the model is wrapped): k x (forward, backward) with the gradient sync only
in the last micro-step, clipping, the non-finite skip (train/skips.py), the optimizer, the schedule and the EMA.
train/graphed.py captures the same arithmetic as a CUDA graph; train/step_mode.py chooses between them."""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, Iterator

import torch

from hpctrain.dist.wrap import ddp_of, fsdp_of, full_value
from hpctrain.errors import UserError, on_every_rank
from hpctrain.experiments.base import BatchInfo, call_train_loss
from hpctrain.train.device import to_device
from hpctrain.train.ema import ema_step
from hpctrain.train.skips import SkipLedger, flag_reader, not_finite
from hpctrain.train.token_loss import TokenLoss, as_token_loss, global_mean, scale_gradients


class EagerStep:
    """The step as Python drives it (eager and compiled modes)."""

    mode = "eager"

    def __init__(self, cache: bool = True) -> None:
        self.recording: list[RecordingInfo] | None = None
        """When a list: this step's BatchInfo of each micro-batch, noting its draws (a graphed step's warm-up)."""
        self.cache = cache
        """Autocast's weight-cast cache; off in a graphed step's eager steps, as in its capture (a compiled model
        would otherwise see another autocast state there, and recompile during the capture)."""
        self.token_loss = False
        """train_loss returns (sum, count): the count's all-reduce sits between the backward passes and the
        optimizer (a graphed step falls back to eager)."""
        self.skips = SkipLedger()
        """The steps skipped for a non-finite gradient (train/skips.py), read by the train record."""
        self.applied = False
        """A step of this launch has updated the weights (not skipped), the same on every rank: from then on a fused
        optimizer skips on a device flag (skips.flag_reader). False at every launch, a resumed one too: its first
        step may create optimizer state the checkpoint has none of (fused SGD's momentum, uninitialised, after
        optim.momentum was raised from 0 or unsaved state was dropped), which a skip on the device would leave so.
        One host wait per launch."""

    def __call__(self, ctx, batches: Iterator, window) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step over grad_accum micro-batches; returns this rank's mean loss (on device, no sync)."""
        accum, step = ctx.batches.grad_accum, ctx.state.step
        if self.recording is not None:
            self.recording[:] = [RecordingInfo(batch_info(ctx, step, micro)) for micro in range(accum)]
        losses = [micro_step(ctx, fetch(ctx, batches, window), step, micro, self._info(micro), self.cache)
                  for micro in range(accum)]
        self.token_loss = self.token_loss or isinstance(losses[0], TokenLoss)
        loss = step_loss(ctx, losses)
        ctx.fault.heartbeat.mark("optimizer")
        return loss, self.finish(ctx, step)

    def finish(self, ctx, step: int) -> torch.Tensor | None:
        """apply_gradients, its skip noted; returns the gradient norm when clipping."""
        norm, skipped = apply_gradients(ctx, device_flag=self.applied)
        self.applied = self.applied or skipped is False  # a host decision, read on every rank alike
        self.skips.note(ctx, step + 1, skipped)
        return norm

    def _info(self, micro: int) -> RecordingInfo | None:
        return None if self.recording is None else self.recording[micro]


def step_loss(ctx, losses: list[torch.Tensor | TokenLoss]) -> torch.Tensor:
    """This rank's mean loss of the step's micro-batches (on device, no sync); for (sum, count) losses the global sum
    over the global count, after which the gradients are scaled to it (train/token_loss.py)."""
    tokens = [loss for loss in losses if isinstance(loss, TokenLoss)]
    if tokens:
        if len(tokens) != len(losses):
            raise on_every_rank(UserError(f"{type(ctx.experiment).__name__}.train_loss returned a mean for some "
                                          "micro-batches and (sum, count) for others",
                                          "return the same kind of loss for every micro-batch."))
        loss, count = global_mean(tokens, ctx.runtime)
        scale_gradients(ctx.raw_model.parameters(), count, ctx.runtime.world_size)
        return loss
    if len(losses) == 1:
        # The usual case, without an accumulator tensor and its two ops per step: (0 + x) / 1 is x, bit for bit.
        return losses[0]
    loss_sum = torch.zeros((), device=ctx.runtime.device)
    for loss in losses:
        loss_sum += loss
    return loss_sum / len(losses)


def fetch(ctx, batches: Iterator, window) -> Any:
    """The next micro-batch, on the device; the time the loader held this rank up goes into the log window."""
    ctx.fault.heartbeat.mark("data")
    waited = time.perf_counter()
    host_batch = next(batches)
    window.data_wait += time.perf_counter() - waited
    if ctx.recorder:  # hpctrain check resume: what this rank trained on
        ctx.recorder.saw(host_batch)
    return to_device(host_batch, ctx.runtime.device, ctx.cfg.train.channels_last_on)


def batch_info(ctx, step: int, micro: int) -> BatchInfo:
    """Where micro-batch ``micro`` of this rank sits in the global batch: per-sample draws then do not depend on the
    world size."""
    plan = ctx.batches
    return BatchInfo("train", step, ctx.runtime.rank * plan.per_rank + micro * plan.micro_batch_size,
                     plan.global_batch_size, ctx.cfg.run.seed)


def micro_step(ctx, batch: Any, step: int, micro: int, info: Any = None,
               cache: bool = True) -> torch.Tensor | TokenLoss:
    """Forward and backward of micro-batch ``micro``; returns its loss, detached, in fp32 (a TokenLoss for a loss
    given as (sum, count))."""
    model, accum, hb = ctx.model, ctx.batches.grad_accum, ctx.fault.heartbeat
    with gradient_sync(model, micro == accum - 1):
        hb.mark("forward")
        with ctx.precision.autocast(cache=cache):
            loss = call_train_loss(ctx.experiment, model, batch, batch_info(ctx, step, micro) if info is None else info)
        hb.mark("backward")
        token = as_token_loss(loss, f"{type(ctx.experiment).__name__}.train_loss")
        if token is not None:  # the sum's gradient; scaled by the global count after the last micro-step
            ctx.scaler.scale(token[0]).backward()
            return TokenLoss(token[0].detach().float(), token[1])
        # loss is a micro-batch mean; / accum makes the accumulated gradient this rank's mean, and DDP averages over
        # ranks: the gradient of the mean over the global batch. Not divided by 1: an op per step for the same result.
        ctx.scaler.scale(loss / accum if accum > 1 else loss).backward()
    return loss.detach().float()


def gradient_sync(model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Gradients are reduced over the ranks only in the last micro-step of an optimizer step: before it that work
    would be thrown away. DDP (ddp, zero1) all-reduces during backward unless inside no_sync(); FSDP2
    reduce-scatters unless told not to (it then accumulates unsharded gradients until the last micro-step)."""
    fsdp = fsdp_of(model)  # under torch.compile too: the compiled module wraps DDP or FSDP
    if fsdp is not None:
        fsdp.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    ddp = ddp_of(model)
    return contextlib.nullcontext() if last or ddp is None else ddp.no_sync()


def apply_gradients(ctx, device_flag: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | bool]:
    """Clip, step, zero, schedule, average: what follows the backward passes. Returns the gradient norm when
    clipping (on device, no sync) and whether the step was skipped for a non-finite gradient (train/skips.py: a
    device flag where the optimizer reads one and ``device_flag`` (a step of this launch has been applied), else a bool
    read on the host). Every rank takes the same path: under zero1 every rank calls step() or none does."""
    norm, skipped = step_optimizer(ctx.optimizer, ctx.scheduler, ctx.scaler, list(ctx.raw_model.parameters()),
                                   ctx.cfg.train.grad_clip, device_flag)
    if ctx.ema is not None:
        ema_step(ctx.ema, ctx.raw_model, skipped)
    return norm, skipped


def step_optimizer(optimizer: torch.optim.Optimizer, scheduler: Any, scaler: torch.amp.GradScaler,
                   params: list[torch.Tensor], clip: float,
                   device_flag: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | bool]:
    """One optimizer's part of apply_gradients, for the gradients of ``params`` (all it steps): unscale (fp16) and
    clip to ``clip`` when > 0, the non-finite skip, step, zero, schedule. Returns (the norm when clipping, skipped)."""
    if clip > 0:
        scaler.unscale_(optimizer)  # clip the true gradient, not the fp16-scaled one
    norm = global_grad_norm(params, clip)
    reader = flag_reader(optimizer, device_flag)
    skipped: torch.Tensor | bool = not_finite(norm) if reader is not None else not bool(torch.isfinite(norm))
    if scaler.is_enabled():
        scaler.step(optimizer)  # fp16: GradScaler skips on its own check of the same gradients
    elif reader is not None:
        reader.found_inf = skipped  # the fused kernels leave weights and state as they were when it is 1
        try:
            optimizer.step()
        finally:
            del reader.found_inf
    elif not skipped:
        optimizer.step()
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    # A skipped step is a step: the schedule moves on, as under GradScaler and in a graph.
    if skipped is True:  # optimizer.step() not called: torch's warning about the order would be wrong here
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            scheduler.step()
    else:
        scheduler.step()
    return (norm if clip > 0 else None), skipped


def global_grad_norm(params: list[torch.Tensor], clip: float) -> torch.Tensor:
    """The norm of the gradients of ``params`` over all ranks, clipped to ``clip`` when > 0: the same value on every
    rank."""
    # Under fsdp the gradients are DTensor shards, and torch reduces their norms over the ranks (every parameter is
    # sharded, the root included; see dist/wrap.py); under DDP and zero1 every rank holds the all-reduced gradients.
    if clip > 0:
        return full_value(torch.nn.utils.clip_grad_norm_(params, clip))
    grads = [p.grad for p in params if p.grad is not None]
    return full_value(torch.nn.utils.get_total_norm(grads))


class RecordingInfo:
    """A BatchInfo that notes each draw the experiment makes (kind, arguments, shape, dtype): a graphed step's
    eager warm-up runs with it, so that the graph's draw buffers can be made before the capture."""

    def __init__(self, info: BatchInfo) -> None:
        self.info = info
        self.draws: list[tuple[str, tuple, dict, torch.Size, torch.dtype]] = []

    def _draw(self, name: str, args: tuple, stream: int, device: Any) -> torch.Tensor:
        kwargs = {"stream": stream, "device": torch.device(device)}
        out = getattr(self.info, name)(*args, **kwargs)
        self.draws.append((name, args, kwargs, out.shape, out.dtype))
        return out

    def randn(self, n: int, *shape: int, stream: int = 0, device: Any = "cpu") -> torch.Tensor:
        return self._draw("randn", (n, *shape), stream, device)

    def rand(self, n: int, *shape: int, stream: int = 0, device: Any = "cpu") -> torch.Tensor:
        return self._draw("rand", (n, *shape), stream, device)

    def randint(self, high: int, n: int, stream: int = 0, device: Any = "cpu") -> torch.Tensor:
        return self._draw("randint", (high, n), stream, device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.info, name)
