"""train.step_mode=graphed: the whole optimizer step captured once per launch with torch.cuda.graph and replayed
every step (k x (forward, backward), the gradient sync, clipping, the non-finite check, the fused optimizer with its
learning rates in device tensors, the EMA): the host launches one graph per step instead of thousands of kernels,
which is what bounds the reference experiments' step on an H100 (BENCHMARKS.md). torch's reduce-overhead mode graphs
only the compiled model; this is the hand capture of MLPerf submissions and torchtitan's graph trainer.

What stays on the host, between replays as between eager steps, each keeping a guarantee of the eager loop: the
batches (copied into static slots), the per-sample draws (drawn by position, copied into static buffers: world-size
invariant), the learning-rate schedule (float rates copied into the graph's tensors before each replay), the stop
vote, heartbeats, logging, validation and checkpoints. Batches that do not fit the captured ones (shape, non-tensor
values) run eagerly; a step that cannot be captured falls back to eager under train.step_mode=auto.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map

from hpctrain.dist.wrap import full_value
from hpctrain.errors import UserError
from hpctrain.experiments.base import BatchInfo
from hpctrain.train.ema import ema_update
from hpctrain.train.skips import not_finite
from hpctrain.train.step import EagerStep, batch_info, fetch, micro_step, step_loss

log = logging.getLogger("hpctrain")

WARMUP_STEPS = 11
"""Eager steps each launch runs before capturing (torch's CUDA notes: at least 11 under DDP, for its bucket
rebuilding; they also create the optimizer state, the cuDNN/cuBLAS handles and, with train.compile, the compiled
kernels, none of which may be created during capture). They are real training steps, not thrown away. If every
one of them was skipped for a non-finite gradient, eager steps go on until one is applied (train/skips.py)."""
MAX_AHEAD = 2
"""Replays the host may enqueue before the GPU has finished them: heartbeats then mean the GPU is progressing (a
hung kernel stops the host within two steps), and the host cannot run arbitrarily far ahead of a slow GPU."""


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
        if self.eager.token_loss:
            raise CaptureError("train_loss returns (sum, count): the count is all-reduced between the backward passes "
                               "and the optimizer, which is not captured yet")
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
        loss = step_loss(ctx, losses) if self.eager.token_loss else \
            torch.stack(losses).mean() if len(losses) > 1 else losses[0]
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
        gc.collect()
