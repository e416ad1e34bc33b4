"""The one owner of the optimizer step (train.step_mode): eager, compiled, or graphed.

eager and compiled run the step as Python drives it (compiled: the model under torch.compile, chosen when the model
is wrapped). graphed captures the whole optimizer step once with torch.cuda.graph and replays it every step:
k x (forward, backward), the gradient sync, clipping, a non-finite check, the fused optimizer with a learning rate
held in device tensors, and the EMA. The host then launches one graph per step instead of ~2,700 kernels (the DDPM
U-Net), which is what bounds the reference experiments' step on an H100 (BENCHMARKS.md). torch's
``mode="reduce-overhead"`` graphs only the compiled model and leaves the optimizer, the EMA and autograd on the host;
this is the hand capture MLPerf submissions and torchtitan's graph trainer use, written here because no library of
the field offers it for an arbitrary training step.

What stays on the host, outside the graph, and why (each keeps a guarantee of the eager loop):
- the batches: the host sampler and loader as in eager mode, each micro-batch copied into a static slot;
- the per-sample draws (BatchInfo.randn/rand/randint): drawn by position outside the graph, copied into static
  buffers, so they stay world-size invariant (their generators are seeded per step, which a replay cannot do);
- the learning-rate schedule: the scheduler moves the optimizer's float rates as in eager mode (so checkpoints are
  unchanged), and each replay first copies them into the device tensors the captured optimizer reads;
- the stop vote, heartbeats, logging, validation and checkpoints, between replays as between eager steps.
The loss and gradient norm come back as device tensors (read by the log window, one step late, never with .item()).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map

from hpctrain.config.schema import RunConfig
from hpctrain.dist.runtime import Runtime
from hpctrain.dist.wrap import ddp_of, fsdp_of, full_value
from hpctrain.errors import UserError
from hpctrain.experiments.base import BatchInfo, call_train_loss
from hpctrain.train.device import to_device
from hpctrain.train.precision import Precision
from hpctrain.train.skips import SkipLedger, flag_reader, not_finite

log = logging.getLogger("hpctrain")

WARMUP_STEPS = 11
"""Eager steps each launch runs before capturing (torch's CUDA notes: at least 11 under DDP, for its bucket
rebuilding; they also create the optimizer state, the cuDNN/cuBLAS handles and, with train.compile, the compiled
kernels, none of which may be created during capture). They are real training steps, not thrown away. If every
one of them was skipped for a non-finite gradient, eager steps go on until one is applied (train/skips.py)."""
MAX_AHEAD = 2
"""Replays the host may enqueue before the GPU has finished them: heartbeats then mean the GPU is progressing (a
hung kernel stops the host within two steps), and the host cannot run arbitrarily far ahead of a slow GPU."""


# ---- choosing the mode -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepChoice:
    mode: str
    """eager, compiled or graphed: what runs."""
    reason: str
    """Why, for the start-up line (train.step_mode=auto says what it picked and why)."""
    fallback: bool = False
    """graphed chosen by auto: a step that cannot be captured (said by hpctrain's own checks) runs eagerly."""
    cudnn_benchmark: bool = False
    """torch.backends.cudnn.benchmark for this run (train.cudnn_benchmark resolved; see cudnn_benchmark)."""
    cudnn_for_graph: bool = False
    """cudnn_benchmark is on only because the step is graphed (train.cudnn_benchmark=auto): an eager fallback turns
    it off again, as auto would have chosen for an eager step."""

    def describe(self) -> str:
        """The start-up line's text."""
        text = f"{self.mode} ({self.reason})"
        return text + ", cudnn.benchmark on" if self.cudnn_benchmark else text


def graph_refusal(cfg: RunConfig, runtime: Runtime, precision: Precision, graphable: bool = True) -> str | None:
    """Why the whole step cannot be captured here, or None when it can."""
    if runtime.device.type != "cuda":
        return "CUDA graphs need a GPU and this run is on the CPU"
    if precision.name == "fp16":
        return ("fp16 needs GradScaler's loss-scale update on the host between steps; use train.precision=bf16 "
                "(GPUs from Ampere on)")
    if runtime.distributed and cfg.dist.strategy != "ddp":
        return f"dist.strategy={cfg.dist.strategy} over {runtime.world_size} processes is not captured yet (ddp is)"
    if runtime.distributed and runtime.backend != "nccl":
        return f"the {runtime.backend} backend's collectives cannot be captured (NCCL's can)"
    if runtime.distributed and cfg.data.on_error == "skip":
        return ("data.on_error=skip can shorten one rank's batch, which would then step eagerly while the others "
                "replay their captured all-reduces")
    if runtime.distributed and cfg.dist.find_unused_parameters:
        return "dist.find_unused_parameters searches the graph on the host after every backward"
    if cfg.optim.name not in ("adamw", "sgd"):
        return f"optim.name={cfg.optim.name} has no fused implementation to capture"
    if not graphable:
        return "the experiment sets graphable=False (its train_loss synchronises with the host)"
    return None


def choose_step_mode(cfg: RunConfig, runtime: Runtime, precision: Precision, graphable: bool = True) -> StepChoice:
    """train.step_mode resolved on this rank's device. auto: graphed on CUDA where the run allows it, in one process
    (with or without gradient accumulation: its GPU test passed on an H100, 2026-11-27); else compiled when
    train.compile=true, else eager. Capture under DDP over several GPUs follows torch's recipe but has not run on
    several GPUs yet: opt-in (train.step_mode=graphed) until it has. graphed where it cannot run: an error that says
    why."""
    choice = _choose(cfg, runtime, precision, graphable)
    on = cudnn_benchmark(cfg, runtime, choice.mode)
    return replace(choice, cudnn_benchmark=on, cudnn_for_graph=on and cfg.train.cudnn_benchmark == "auto")


def cudnn_benchmark(cfg: RunConfig, runtime: Runtime, mode: str) -> bool:
    """train.cudnn_benchmark resolved: auto is on for a graphed step on CUDA (fixed shapes; measured on one H100
    for DeepLabV3+ R101 at batch 96, graphed: 1,008 -> 1,106 images/s, BENCHMARKS.md), off elsewhere."""
    if runtime.device.type != "cuda":
        return False
    setting = cfg.train.cudnn_benchmark
    return setting == "on" or (setting == "auto" and mode == "graphed")


def _choose(cfg: RunConfig, runtime: Runtime, precision: Precision, graphable: bool) -> StepChoice:
    requested = cfg.train.step_mode
    refusal = graph_refusal(cfg, runtime, precision, graphable)
    if requested == "graphed":
        if refusal:
            raise UserError(f"train.step_mode=graphed: {refusal}",
                            "use train.step_mode=auto (graphed where it can run, eager elsewhere) or eager.")
        return StepChoice("graphed", "asked for (train.step_mode=graphed)")
    if requested == "auto":
        if refusal is None and not runtime.distributed:
            return StepChoice("graphed", "auto: one process on CUDA", fallback=True)
        if refusal is None:
            refusal = "capture under DDP over several GPUs is opt-in (train.step_mode=graphed)"
        other = "compiled" if cfg.train.compile else "eager"
        return StepChoice(other, f"auto: not graphed, {refusal}")
    return StepChoice(requested, f"asked for (train.step_mode={requested})")


# ---- eager ---------------------------------------------------------------------------------------------------

class EagerStep:
    """The step as Python drives it (eager and compiled modes)."""

    mode = "eager"

    def __init__(self, cache: bool = True) -> None:
        self.recording: list[RecordingInfo] | None = None
        """When a list: this step's BatchInfo of each micro-batch, noting its draws (a graphed step's warm-up)."""
        self.cache = cache
        """Autocast's weight-cast cache; off in a graphed step's eager steps, as in its capture (a compiled model
        would otherwise see another autocast state there, and recompile during the capture)."""
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
        if accum == 1:
            # The usual case, without an accumulator tensor and its two ops per step: (0 + x) / 1 is x, bit for bit.
            loss = micro_step(ctx, fetch(ctx, batches, window), step, 0, self._info(0), self.cache)
        else:
            loss_sum = torch.zeros((), device=ctx.runtime.device)
            for micro in range(accum):
                loss_sum += micro_step(ctx, fetch(ctx, batches, window), step, micro, self._info(micro), self.cache)
            loss = loss_sum / accum
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


def fetch(ctx, batches: Iterator, window) -> Any:
    """The next micro-batch, on the device; the time the loader held this rank up goes into the log window."""
    ctx.fault.heartbeat.mark("data")
    waited = time.perf_counter()
    host_batch = next(batches)
    window.data_wait += time.perf_counter() - waited
    return to_device(host_batch, ctx.runtime.device, ctx.cfg.train.channels_last_on)


def batch_info(ctx, step: int, micro: int) -> BatchInfo:
    """Where micro-batch ``micro`` of this rank sits in the global batch: per-sample draws then do not depend on the
    world size."""
    plan = ctx.batches
    return BatchInfo("train", step, ctx.runtime.rank * plan.per_rank + micro * plan.micro_batch_size,
                     plan.global_batch_size, ctx.cfg.run.seed)


def micro_step(ctx, batch: Any, step: int, micro: int, info: Any = None, cache: bool = True) -> torch.Tensor:
    """Forward and backward of micro-batch ``micro``; returns its loss, detached, in fp32."""
    model, accum, hb = ctx.model, ctx.batches.grad_accum, ctx.fault.heartbeat
    with gradient_sync(model, micro == accum - 1):
        hb.mark("forward")
        with ctx.precision.autocast(cache=cache):
            loss = call_train_loss(ctx.experiment, model, batch, batch_info(ctx, step, micro) if info is None else info)
        hb.mark("backward")
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
    clip = ctx.cfg.train.grad_clip
    if clip > 0:
        ctx.scaler.unscale_(ctx.optimizer)  # clip the true gradient, not the fp16-scaled one
    norm = global_grad_norm(ctx, clip)
    reader = flag_reader(ctx.optimizer, device_flag)
    skipped: torch.Tensor | bool = not_finite(norm) if reader is not None else not bool(torch.isfinite(norm))
    if ctx.scaler.is_enabled():
        ctx.scaler.step(ctx.optimizer)  # fp16: GradScaler skips on its own check of the same gradients
    elif reader is not None:
        reader.found_inf = skipped  # the fused kernels leave weights and state as they were when it is 1
        try:
            ctx.optimizer.step()
        finally:
            del reader.found_inf
    elif not skipped:
        ctx.optimizer.step()
    ctx.scaler.update()
    ctx.optimizer.zero_grad(set_to_none=True)
    # A skipped step is a step: the schedule moves on, as under GradScaler and in a graph.
    if skipped is True:  # optimizer.step() not called: torch's warning about the order would be wrong here
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            ctx.scheduler.step()
    else:
        ctx.scheduler.step()
    if ctx.ema is not None:
        ema_step(ctx.ema, ctx.raw_model, skipped)
    return (norm if clip > 0 else None), skipped


def global_grad_norm(ctx, clip: float) -> torch.Tensor:
    """The norm of all gradients of all ranks, clipped to ``clip`` when > 0: the same value on every rank."""
    # Under fsdp the gradients are DTensor shards, and torch reduces their norms over the ranks (every parameter is
    # sharded, the root included; see dist/wrap.py); under DDP and zero1 every rank holds the all-reduced gradients.
    if clip > 0:
        return full_value(torch.nn.utils.clip_grad_norm_(ctx.raw_model.parameters(), clip))
    grads = [p.grad for p in ctx.raw_model.parameters() if p.grad is not None]
    return full_value(torch.nn.utils.get_total_norm(grads))


def ema_step(ema, model: torch.nn.Module, skipped: torch.Tensor | bool) -> None:
    """The EMA's update after this step; a skipped step leaves its weights as they were (its count moves on)."""
    if skipped is False or int(ema.n_averaged) == 0:
        ema.update_parameters(model)  # the first update copies the model, which a skipped step left as it was
        return
    if skipped is not True:  # a device flag: the EMA keeps its values where it is 1, no host read
        ema_update(ema, model, 1 - ema.decay, skipped)
    ema.n_averaged += 1


# ---- graphed -------------------------------------------------------------------------------------------------

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


class StaticDraws:
    """Stands in for BatchInfo inside the captured step: the draws the eager warm-up recorded, each in a static
    device buffer that :meth:`refill` fills before every replay with the same draw of that step's real BatchInfo.

    The buffers are made before the capture, not during it: memory allocated during a capture may be memory an
    earlier part of the same graph used and freed (the graph's pool reuses it), which a replay would overwrite
    after the refill wrote it (with gradient accumulation the second micro-batch's timesteps were the first
    micro-batch's activations: measured, an index out of bounds on the first replay)."""

    def __init__(self, device: torch.device, planned: list[tuple[str, tuple, dict, torch.Size, torch.dtype]]) -> None:
        self.device = device
        """The run's device: a draw elsewhere (on the host) cannot be part of its graph."""
        for name, _, kwargs, _, _ in planned:
            if kwargs["device"].type != device.type:
                raise CaptureError(f"BatchInfo.{name}(..., device='{kwargs['device']}') in a step captured on "
                                   f"{device}: a tensor on another device cannot be part of its graph; draw with "
                                   "device=<the batch's device>")
        self.draws = [(name, args, kwargs, torch.empty(shape, dtype=dtype, device=kwargs["device"]))
                      for name, args, kwargs, shape, dtype in planned]
        self.cursor = 0
        """Draws handed out since the last refill: a body run again in Python (the CPU stand-in for a graph in the
        tests) gets the same buffers in the same order."""

    def _take(self, name: str, args: tuple, stream: int, device: Any) -> torch.Tensor:
        call = (name, args, {"stream": stream, "device": torch.device(device)})
        if self.cursor >= len(self.draws) or self.draws[self.cursor][:3] != call:
            raise CaptureError(f"BatchInfo.{name}{args} (stream {stream}) in the captured step is not the draw the "
                               "eager steps made there: the step's draws must be the same at every step")
        self.cursor += 1
        return self.draws[self.cursor - 1][3]

    def randn(self, n: int, *shape: int, stream: int = 0, device: Any = "cpu") -> torch.Tensor:
        return self._take("randn", (n, *shape), stream, device)

    def rand(self, n: int, *shape: int, stream: int = 0, device: Any = "cpu") -> torch.Tensor:
        return self._take("rand", (n, *shape), stream, device)

    def randint(self, high: int, n: int, stream: int = 0, device: Any = "cpu") -> torch.Tensor:
        return self._take("randint", (high, n), stream, device)

    def __getattr__(self, name: str) -> Any:
        # step, start, total, seed, split: a value read during capture would be frozen into every replay.
        raise CaptureError(f"BatchInfo.{name} read inside the captured step: its value would be the same at every "
                           "replay; draw with info.randn/rand/randint, or set graphable = False on the experiment")

    def refill(self, info: BatchInfo) -> None:
        self.cursor = 0
        for name, args, kwargs, buffer in self.draws:
            buffer.copy_(getattr(info, name)(*args, **kwargs))


STATIC_LEAVES = (torch.Tensor, int, float, bool, str, type(None))
"""What a batch may hold to be a graph's input: tensors (copied in at each step) and constants."""


class CaptureError(RuntimeError):
    """What the training step does cannot be captured (said in the message)."""


class CudaGraph:
    """torch.cuda.graph, behind the small interface GraphedStep uses (tests replace it on the CPU)."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, body: Callable[[], None]) -> None:
        failure: list[BaseException] = []
        stream = torch.cuda.current_stream()  # torch leaves its capture stream current when the capture's end fails
        try:
            # thread_local: the checkpoint writer and the heartbeat threads may use CUDA while this thread captures.
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                try:
                    body()
                except BaseException as e:  # noqa: BLE001 - ended below, after the capture is closed
                    failure.append(e)
        except RuntimeError:
            torch.cuda.set_stream(stream)
            if not failure:
                raise
        if failure:  # the body's own error says what to change; the capture's end would only say it was invalidated
            raise failure[0]
        torch.cuda.empty_cache()  # the eager warm-up's cached blocks: the graph has its own pool from here on

    def replay(self) -> None:
        self.graph.replay()

    @staticmethod
    @contextlib.contextmanager
    def side_stream(owner: Any):
        """Eager warm-up steps run on a side stream, as torch's notes on whole-network capture require: one per
        owner (a new stream per step would cache each step's activations apart, and a cuBLAS workspace each)."""
        stream = owner.__dict__.setdefault("_side_stream", torch.cuda.Stream())
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream().wait_stream(stream)

    @staticmethod
    def event() -> Any:
        event = torch.cuda.Event()
        event.record()
        return event


class GraphedStep:
    """The whole optimizer step captured once per launch (after WARMUP_STEPS eager steps) and replayed."""

    mode = "graphed"

    def __init__(self, warmup: int = WARMUP_STEPS, graph_class: type = CudaGraph, fallback: bool = False,
                 cudnn_for_graph: bool = False) -> None:
        self.warmup_left = max(1, warmup)  # at least one eager step: it notes the draws the capture needs
        self.graph_class = graph_class
        self.fallback = fallback
        """train.step_mode=auto: a step that cannot be captured runs eagerly (with a warning) instead of failing."""
        self.cudnn_for_graph = cudnn_for_graph
        """StepChoice.cudnn_for_graph: the fallback to eager turns cuDNN's algorithm search off."""
        self.eager = EagerStep(cache=False)
        self.eager.recording = []  # the warm-up notes the draws, for the capture's buffers
        self.skips = self.eager.skips  # one ledger for the eager steps and the replays
        self.graph: Any = None
        self.failed = ""
        self.pending: collections.deque = collections.deque()
        self.warned: set[str] = set()
        """The kinds of eager steps among replays already said in the log (once each)."""

    def __call__(self, ctx, batches: Iterator, window) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.failed:
            return self.eager(ctx, batches, window)
        if self.graph is None:
            window.disturbed = True  # warm-up steps and the capture: not the replayed step's GPU time
            if self.warmup_left > 0 or not self.eager.applied:
                # Captured only after a step has been applied: the optimizer state the graph steps must exist
                # (made in the capture, its zero-fill would be replayed every step), and so must fused SGD's
                # initialised momentum. A run whose first steps are all skipped warms up until one is applied.
                self.warmup_left = max(0, self.warmup_left - 1)
                with self.graph_class.side_stream(self):
                    return self.eager(ctx, batches, window)
        step = ctx.state.step
        micro = [fetch(ctx, batches, window) for _ in range(ctx.batches.grad_accum)]
        if self.graph is None:
            self._capture_or_fall_back(ctx, micro)
            if self.failed:
                return self._eager_with(ctx, micro, step)
        misfit = self._misfit(micro)
        if misfit:
            window.disturbed = True  # an eager step among replays
            if ctx.runtime.distributed:  # the other ranks replay captured all-reduces this rank would not join
                raise UserError(f"train.step_mode=graphed: step {step} has {misfit.text} on rank {ctx.runtime.rank}",
                                misfit.hint + "set train.step_mode=eager for this data.")
            return self._eager_with(ctx, micro, step, misfit)
        ctx.fault.heartbeat.mark("forward")
        self._load(ctx, micro, step)
        self.graph.replay()
        self.skips.note(ctx, step + 1, self.found_inf)
        self._after_replay(ctx)
        return self.loss_out.clone(), (self.norm_out.clone() if ctx.cfg.train.grad_clip > 0 else None)

    # -- capture -----------------------------------------------------------------------------------------------

    def _capture_or_fall_back(self, ctx, micro: list) -> None:
        try:
            self._capture(ctx, micro)
        except CaptureError as e:  # found by hpctrain before the capture broke: the process is sound, go on eagerly
            self._give_up(ctx, str(e))
        except RuntimeError as e:
            # torch's own refusal (a host synchronisation, a CPU op, an unregistered generator) invalidates the
            # capture, and torch leaves its allocator and generators in states it does not promise to recover from:
            # stop with the reason rather than go on in this process, also under auto.
            self._restore_optimizer(ctx.optimizer)
            mode = f"train.step_mode={'auto' if self.fallback else 'graphed'}"
            if isinstance(e, torch.OutOfMemoryError):  # the graph's pool comes on top of the eager warm-up's peak
                raise UserError(f"{mode}: out of GPU memory while capturing the training step as a CUDA graph: {e}",
                                "lower train.micro_batch_size (with the same global batch: more accumulation), or set "
                                "train.step_mode=eager.") from e
            raise UserError(f"{mode}: the training step could not be captured as a CUDA graph: {e}",
                            "set train.step_mode=eager (or compiled) for this experiment, or make its train_loss "
                            "free of host synchronisation (.item(), data-dependent shapes) and CPU tensors.") from e

    def _give_up(self, ctx, why: str) -> None:
        self._restore_optimizer(ctx.optimizer)
        if not self.fallback:
            raise UserError(f"train.step_mode=graphed: {why}",
                            "use train.step_mode=eager (or auto, which falls back to eager with a warning).")
        self.failed, self.graph = why, None
        self.eager.recording = None
        searching = self.cudnn_for_graph and torch.backends.cudnn.benchmark
        if searching:  # eager steps may meet new shapes (an epoch's short last batch): each would pay a search
            torch.backends.cudnn.benchmark = False
        if ctx.runtime.is_main:
            log.warning("train.step_mode=auto: the step cannot be captured, running eagerly%s: %s",
                        " (cudnn.benchmark off again)" if searching else "", why)

    def _capture(self, ctx, micro: list) -> None:
        device, opt = ctx.runtime.device, ctx.optimizer
        odd = sorted({type(x).__name__ for b in micro for x in tree_flatten(b)[0] if not isinstance(x, STATIC_LEAVES)})
        if odd:  # e.g. JPEG bytes decoded inside the step (model.gpu_decode): work a replay would not redo
            raise CaptureError(f"the batch holds {', '.join(odd)}, not tensors: the graph can only take tensors as "
                               "its inputs, copied into it at each step")
        self.static = [tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, b) for b in micro]
        self.key = [batch_key(b) for b in self.static]  # once: every step compares its batches with these
        if len(self.eager.recording) != len(micro):
            raise CaptureError("no eager step ran before the capture (train.step_mode=graphed needs its warm-up)")
        self.infos = [StaticDraws(device, r.draws) for r in self.eager.recording]
        for k, draws in enumerate(self.infos):  # the capture step's own draws: a stand-in graph runs the body
            draws.refill(batch_info(ctx, ctx.state.step, k))
        self.lrs = [torch.tensor(float(g["lr"]), dtype=torch.float32, device=device) for g in opt.param_groups]
        if not all(g.get("fused") for g in opt.param_groups):
            raise CaptureError("the optimizer is not fused: a captured step could not skip a non-finite gradient")
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.ema_weight = None
        if ctx.ema is not None:
            self.ema_weight = torch.tensor(1.0 - ctx.ema.decay, dtype=torch.float32, device=device)
            if int(ctx.ema.n_averaged) == 0:
                raise CaptureError("the EMA has not been initialised by an eager step before capture")
        opt.zero_grad(set_to_none=True)  # the captured backward allocates the gradients in the graph's own pool
        graph = self.graph_class()
        graph.capture(lambda: self._captured(ctx))
        self.graph = graph
        self.eager.recording = None  # eager steps from here on (another batch shape) have nothing to note
        if ctx.runtime.is_main:
            log.info("step captured as a CUDA graph at step %d (%d micro-batch(es), %d draw(s)); replayed from here",
                     ctx.state.step, len(micro), sum(len(i.draws) for i in self.infos))

    def _captured(self, ctx) -> None:
        """The body with the optimizer set up as the graph needs it, and put back after (Python only: the graph
        keeps the device tensors it read)."""
        self._prepare_optimizer(ctx.optimizer, ctx.runtime.device)
        try:
            self._body(ctx)
        finally:
            self._restore_optimizer(ctx.optimizer)

    def _prepare_optimizer(self, opt: torch.optim.Optimizer, device: torch.device) -> None:
        """The optimizer as the graph needs it while capturing: rates read from device tensors, the step counter on
        the device (capturable), and the non-finite flag the fused kernels skip on."""
        self._saved_groups = [dict(g) for g in opt.param_groups]
        for group, lr in zip(opt.param_groups, self.lrs):
            group["lr"] = lr
            if "capturable" in group and device.type == "cuda":
                group["capturable"] = True
        if self.found_inf is not None:
            opt.found_inf = self.found_inf

    def _restore_optimizer(self, opt: torch.optim.Optimizer) -> None:
        # Floats again outside the graph: the scheduler, the logs and the checkpoints see what eager mode has.
        for group, saved in zip(opt.param_groups, getattr(self, "_saved_groups", [])):
            group["lr"] = saved["lr"]
            if "capturable" in saved:
                group["capturable"] = saved["capturable"]
        if hasattr(opt, "found_inf"):
            del opt.found_inf

    def _body(self, ctx) -> None:
        """What the graph holds: the eager step's arithmetic, with every host value read from a device tensor."""
        total = None
        for k, batch in enumerate(self.static):
            loss = micro_step(ctx, batch, 0, k, info=self.infos[k], cache=False)
            total = loss if total is None else total + loss
        accum = len(self.static)
        self.loss_out = total / accum if accum > 1 else total
        params = [p for p in ctx.raw_model.parameters() if p.grad is not None]
        clip = ctx.cfg.train.grad_clip
        if clip > 0:
            norm = full_value(torch.nn.utils.clip_grad_norm_(params, clip, foreach=True))
        else:
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params])))
        self.norm_out = norm
        # A step whose gradient is not finite is skipped by the fused optimizer and the EMA (train/skips.py's rule).
        self.found_inf.copy_(not_finite(norm))
        ctx.optimizer.step()
        if ctx.ema is not None:
            ema_update(ctx.ema, ctx.raw_model, self.ema_weight, self.found_inf)

    # -- every step --------------------------------------------------------------------------------------------

    def _misfit(self, micro: list) -> Misfit | None:
        """How this step's batches differ from the captured ones (None: they fit): a replay would run the captured
        shapes and the captured non-tensor values (a per-batch loss weight, a mixup lambda, a task id)."""
        for batch, key in zip(micro, self.key):
            spec, shapes, constants = batch_key(batch)
            if (spec, shapes) != key[:2]:
                return Misfit("shape", "a batch of another shape than the captured one", "")
            if constants != key[2]:
                changed = next(i for i, (a, b) in enumerate(zip(constants, key[2])) if a != b)
                now, then = constants[changed][1], key[2][changed][1]
                return Misfit("value", f"a batch whose non-tensor value {changed} ({type(now).__name__}) is {now!r}, "
                              f"captured as {then!r}",
                              "return it from the collate as a tensor (copied into the graph at every step), or ")
        return None

    def _load(self, ctx, micro: list, step: int) -> None:
        for k, batch in enumerate(micro):
            for dst, src in zip(tree_flatten(self.static[k])[0], tree_flatten(batch)[0]):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src, non_blocking=True)
            self.infos[k].refill(batch_info(ctx, step, k))
        for tensor, group in zip(self.lrs, ctx.optimizer.param_groups):
            tensor.fill_(group["lr"])

    def _after_replay(self, ctx) -> None:
        """What eager mode does on the host after its optimizer step: the schedule and the EMA's counter."""
        ctx.fault.heartbeat.mark("optimizer")
        ctx.scheduler.step()
        if ctx.ema is not None:
            ctx.ema.n_averaged += 1
        self.pending.append(self.graph_class.event())
        while len(self.pending) > MAX_AHEAD:
            self.pending.popleft().synchronize()

    def _eager_with(self, ctx, micro: list, step: int,
                    misfit: Misfit | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A step with batches the graph was not captured for (a shorter batch, another non-tensor value): run
        eagerly. Its gradients must not add to the graph's: those tensors are set aside first (the graph keeps
        writing its own memory)."""
        if misfit is not None and misfit.kind not in self.warned and ctx.runtime.is_main:
            self.warned.add(misfit.kind)
            log.warning("step %d: %s; such steps run eagerly (a replay would use the captured one)%s", step,
                        misfit.text, f". To keep them in the graph: {misfit.hint.removesuffix(', or ')}"
                        if misfit.hint else "")
        ctx.optimizer.zero_grad(set_to_none=True)
        batches = iter(micro)
        losses = [micro_step(ctx, next(batches), step, k, cache=False) for k in range(len(micro))]
        ctx.fault.heartbeat.mark("optimizer")
        loss = torch.stack(losses).mean() if len(losses) > 1 else losses[0]
        return loss, self.eager.finish(ctx, step)


@dataclass(frozen=True)
class Misfit:
    kind: str
    """shape or value: each kind is said once in the log."""
    text: str
    """What differs, for the log line and the error."""
    hint: str
    """What keeps such batches in the graph ('' when nothing does)."""


def batch_key(batch: Any) -> tuple[Any, list, list]:
    """What a captured step holds fixed about a micro-batch: its structure, its tensors' shapes and its non-tensor
    leaves (type and value: True, 1 and 1.0 are different constants to the step's code)."""
    leaves, spec = tree_flatten(batch)
    shapes = [tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]
    return spec, shapes, [(type(x), x) for x in leaves if not isinstance(x, torch.Tensor)]


def release_step(ctx) -> None:
    """Drop a captured graph before the process group goes: NCCL's communicator destroy waits for every graph that
    captured its collectives (pytorch#115388)."""
    stepper = getattr(ctx, "stepper", None)
    if getattr(stepper, "graph", None) is not None:
        if ctx.runtime.device.type == "cuda":
            torch.cuda.synchronize(ctx.runtime.device)
        stepper.graph = None
        ctx.stepper = EagerStep()
        import gc

        gc.collect()


@torch.no_grad()
def ema_update(ema, model: torch.nn.Module, weight: torch.Tensor | float, skipped: torch.Tensor | None = None) -> None:
    """EMA.update_parameters' lerp with the weight (1 - decay) in a device tensor, so a captured update reads it
    at every replay (a Python float would be frozen into the graph). ``skipped`` (a device flag, 1.0 for a skipped
    step): the EMA keeps its values, selected with torch.where, not weighted by 0: the skipped step's forward may have
    made the model's batch-norm statistics NaN, and 0 x NaN is NaN. The parameters need no select (one kernel per
    tensor on the host's path): a skipped step left the model's as they were, the ones the EMA already took in. The
    buffers go as a few flat tensors (:func:`_flat_update`), not one by one."""
    from hpctrain.train.ema import _local

    if skipped is not None:
        weight = weight * (1 - skipped)
    params = [(_local(a), _local(b)) for a, b in zip(ema.module.parameters(), model.parameters(), strict=True)]
    floats = [(a, b) for a, b in params if a.is_floating_point()]
    if floats:
        ema_t, cur_t = [a for a, _ in floats], [b for _, b in floats]
        delta = torch._foreach_sub(cur_t, ema_t)
        torch._foreach_mul_(delta, weight)
        torch._foreach_add_(ema_t, delta)
    rest = [(a, b) for a, b in params if not a.is_floating_point()]
    rest += [(_local(a), _local(b)) for a, b in zip(ema.module.buffers(), model.buffers(), strict=True)]
    _flat_update(rest, weight, None if skipped is None else skipped.bool())


def _flat_update(pairs: list[tuple[torch.Tensor, torch.Tensor]], weight, keep: torch.Tensor | None) -> None:
    """The EMA's buffers (and any integer parameters) updated per (device, dtype) group: the EMA's and the model's
    joined into one flat tensor each (torch.cat; torch.stack for 0-d ones such as batch norm's num_batches_tracked),
    the update and the skip's select on those, the result copied back through views (one _foreach_copy_): a handful of
    operations however many buffers, not five per buffer, which an eager step pays on the host and a captured one in
    kernels at every replay (a BatchNorm model has three buffers per layer). The values are those of the update
    tensor by tensor, bit for bit (the same elementwise operations). No host read and no data-dependent shape: it is
    captured in a CUDA graph as it is."""
    groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for a, b in pairs:
        if a.dim() > 1 and not a.is_contiguous():  # no flat view to write through (never seen): on its own
            new = _buffer_update(a, b, weight)
            a.copy_(new if keep is None else torch.where(keep, a, new))
            continue
        groups.setdefault((a.device, a.dtype, a.dim() == 0), []).append((a, b))
    for (_, _, scalars), group in groups.items():
        if scalars:  # stacked: one operation, however many (a view each would be one per buffer)
            mine = [a for a, _ in group]
            mine_flat, theirs_flat = torch.stack(mine), torch.stack([b for _, b in group])
        else:  # a 1-D tensor as it is (no operation), others as a flat view, which writes reach the buffer through
            mine = [a if a.dim() == 1 else a.view(-1) for a, _ in group]
            theirs = [b if b.dim() == 1 else b.reshape(-1) for _, b in group]
            mine_flat = mine[0] if len(mine) == 1 else torch.cat(mine)
            theirs_flat = theirs[0] if len(theirs) == 1 else torch.cat(theirs)
        new = _buffer_update(mine_flat, theirs_flat, weight)
        if keep is not None:
            new = torch.where(keep, mine_flat, new)
        new = new.to(mine_flat.dtype)  # as copy_ converts (an integer buffer truncates)
        if scalars:
            torch._foreach_copy_(mine, new.unbind())
        elif len(mine) == 1:
            mine[0].copy_(new)
        else:
            torch._foreach_copy_(mine, new.split([t.numel() for t in mine]))


def _buffer_update(a: torch.Tensor, b: torch.Tensor, weight) -> torch.Tensor:
    if a.is_floating_point():
        return a + (b - a) * weight
    return a * (1 - weight) + b * weight  # eager's formula, truncated by the copy into the integer buffer


def build_step(choice: StepChoice) -> EagerStep | GraphedStep:
    if choice.mode == "graphed":
        return GraphedStep(fallback=choice.fallback, cudnn_for_graph=choice.cudnn_for_graph)
    return EagerStep()
