"""One optimizer step of a multi-model step or a user's loop: its micro-batches, the backward passes, the optimizer
steps and the values it logs.

``micro_batches(name)`` runs over this rank's micro-batches of the step for optimizer ``name``. The models it steps
have their gradient sync on in the last micro-batch only (DDP's no_sync, FSDP2's set_requires_gradient_sync): one
all-reduce (or reduce-scatter) per optimizer step. The other trainable models are switched off for the pass
(requires_grad False, no sync): a generator's loss read through the discriminator neither computes nor
accumulates the discriminator's gradients, which its own pass must not find. The micro-batches are fetched once and
kept (on the device) for the step, so the next optimizer's pass sees the same ones.

``backward(loss)`` takes the micro-batch's mean loss (divided by the accumulation here, averaged over the ranks by
DDP and FSDP) or a ``(sum, count)`` pair (the gradient of the global sum over the global count, train/token_loss.py),
through the optimizer's GradScaler under fp16. ``optimizer_step(name)`` scales a (sum, count) optimizer's gradients
to the global count, clips, skips a non-finite step (train/skips.py's rule), steps, zeroes and schedules.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from hpctrain.dist.wrap import ddp_of, fsdp_of, reshard
from hpctrain.experiments.base import BatchInfo
from hpctrain.userloop.objects import misuse
from hpctrain.train.device import to_device
from hpctrain.train.ema import ema_step
from hpctrain.train.step import step_optimizer
from hpctrain.train.token_loss import as_token_loss, scale_gradients

if TYPE_CHECKING:
    from hpctrain.userloop.core import TrainingSession


class Step:
    """Handed out by run.steps (and to StepExperiment.train_step) once per optimizer step."""

    def __init__(self, session: "TrainingSession", batches: Iterator, index: int, epoch: int) -> None:
        self._session = session
        self._source = batches
        self.index = index
        """The optimizer step (0-based): BatchInfo.step of its micro-batches."""
        self.epoch = epoch
        """The epoch it belongs to (0-based)."""
        self._cache: list[tuple[Any, BatchInfo]] = []
        self._kinds: dict[str, str] = {}
        """Per optimizer, the kind of loss its backward passes took this step: mean or ratio."""
        self._counts: dict[str, torch.Tensor] = {}
        self._skipped: dict[str, Any] = {}
        self._phase: str | None = None
        self._pass_done = True
        """The latest pass over micro_batches ran its last micro-batch's backward, or ran to its end (or none was
        made): its gradients are synced."""
        self._last_micro = False
        self._left: str | None = None
        """A pass left before its end (sticky for the step): which one."""
        self._closed = False

    # -- what the user sees -------------------------------------------------------------------------------------

    @property
    def eval_due(self) -> bool:
        """Validation is due after this step (eval.every_steps, the end of an epoch, the last step)."""
        return self._session.eval_due_after(self)

    @property
    def last(self) -> bool:
        """This launch's last step."""
        return self.index + 1 >= self._session.ctx.end_step

    def micro_batches(self, optimizer: str | None = None) -> Iterator[tuple[Any, BatchInfo]]:
        """(batch, info) for each of this rank's micro-batches of the step, on the device, for the optimizer named
        (None: every trainable model syncs in the last micro-batch, none is switched off). Run it again for the next
        optimizer: the same micro-batches."""
        self._check_open("micro_batches")
        ctx = self._session.ctx
        if optimizer is not None and optimizer not in self._session.objects.optimizers:
            raise misuse(f"step.micro_batches('{optimizer}'): no optimizer of that name is registered",
                         f"name one of {sorted(self._session.objects.optimizers)}, or none.")
        if self._phase is not None:
            raise misuse("step.micro_batches inside another pass of step.micro_batches",
                         "finish one pass over the micro-batches before starting the next.")
        accum = ctx.batches.grad_accum
        syncing, off = self._session.phase_models(optimizer)
        saved = _switch_off(off)
        self._phase = optimizer or ""
        self._pass_done = False
        try:
            for micro in range(accum):
                batch, info = self._micro_batch(micro)
                last = micro == accum - 1
                with contextlib.ExitStack() as stack:
                    for name, entry in self._session.objects.models.items():
                        if entry.trainable:
                            stack.enter_context(_gradient_sync(entry.wrapped, last and name in syncing))
                    ctx.fault.heartbeat.mark("forward")
                    self._last_micro = last
                    with ctx.precision.autocast():
                        yield batch, info
            self._pass_done = True
        finally:
            if not self._pass_done and self._left is None:
                self._left = f"step.micro_batches({optimizer!r})" if optimizer else "step.micro_batches()"
            self._phase, self._last_micro = None, False
            _restore(saved)

    def backward(self, loss: Any, optimizer: str | None = None) -> None:
        """Backward of one micro-batch's loss: a mean over the micro-batch (a 0-d tensor) or a pair ``(sum, count)``.
        ``optimizer``: whose loss scaler (fp16) and count it is; default the pass's optimizer (micro_batches(name)),
        or the only one."""
        self._check_open("backward")
        session = self._session
        names = self._loss_owners(optimizer)
        token = as_token_loss(loss, "step.backward")
        kind = "mean" if token is None else "ratio"
        for name in names:
            if self._kinds.setdefault(name, kind) != kind:
                raise misuse(f"step.backward: optimizer '{name}' got a mean loss and a (sum, count) in one step",
                             "give each optimizer's losses in one form within a step.")
            if token is not None:
                self._counts[name] = self._counts.get(name, 0.0) + token[1]
        if token is not None:
            session.ratio_optimizers.update(names)
        accum = session.ctx.batches.grad_accum
        value = token[0] if token is not None else (loss / accum if accum > 1 else loss)
        scaler = session.objects.scalers[names[0]] if names else None
        if scaler is not None and scaler.is_enabled():
            self._check_own_scaler(names[0])
        session.ctx.fault.heartbeat.mark("backward")
        with torch.autocast(session.ctx.runtime.device.type, enabled=False):  # the backward as an Experiment's
            (scaler.scale(value) if scaler is not None else value).backward()
        if self._last_micro:  # the syncing backward of the pass: from here on its optimizer may step
            self._pass_done = True

    def optimizer_step(self, name: str | None = None, clip: float | None = None) -> torch.Tensor | None:
        """Step optimizer ``name`` (default: the only one) on the gradients its backward passes accumulated:
        scaled to the global count of (sum, count) losses, clipped to ``clip`` (default train.grad_clip; 0: no
        clipping), skipped when not finite, then zeroed; in a StepExperiment its schedule steps too (in a loop of
        your own, step your schedulers yourself). Returns the gradient norm when clipping. Every rank calls it, in
        the same order."""
        self._check_open("optimizer_step")
        session = self._session
        name = self._only_optimizer(name, "step.optimizer_step")
        if name in self._skipped:
            raise misuse(f"step.optimizer_step('{name}') twice in one step",
                         "step each optimizer once per step; for more updates, use more steps.")
        params = session.objects.optimizer_params(name)
        if self._left is not None or not self._pass_done:
            raise self._left_pass(f"step.optimizer_step('{name}')")
        if name in session.ratio_optimizers:
            scale_gradients(params, self._global_count(name), session.ctx.runtime.world_size)
        session.ctx.fault.heartbeat.mark("optimizer")
        clip = session.ctx.cfg.train.grad_clip if clip is None else clip
        scheduler = _Schedules(session.objects.schedulers_of(name) if session.steps_schedules else [])
        norm, skipped = step_optimizer(session.objects.optimizers[name], scheduler, session.objects.scalers[name],
                                       params, clip, device_flag=session.applied.get(name, False))
        session.applied[name] = session.applied.get(name, False) or skipped is False
        self._skipped[name] = skipped
        if norm is not None:
            session.window.grad_norms[name] = norm
        return norm

    def log(self, **values: Any) -> None:
        """Values for the train records: a mean (a 0-d tensor or a number; averaged over the ranks and the steps
        since the last record) or a pair (sum, count) (summed over both, then divided). Every rank logs the same
        names. No host synchronisation: the values stay on the device until the record."""
        self._check_open("log")
        for name, value in values.items():
            if isinstance(value, (tuple, list)):
                if len(value) != 2:
                    raise misuse(f"step.log({name}=...): a tuple of {len(value)}", "log a mean or a (sum, count) pair.")
                total, count = value
                self._session.window.add_named(name, "ratio", _detached(total), _detached(count))
            else:
                self._session.window.add_named(name, "mean", _detached(value), 1.0)

    @property
    def models(self) -> dict[str, torch.nn.Module]:
        """The registered models as wrapped (what the forward runs on), by name."""
        return {name: entry.wrapped for name, entry in self._session.objects.models.items()}

    # -- the session's side --------------------------------------------------------------------------------------

    def close(self) -> None:
        """After the user's work on the step: the micro-batches nobody asked for are still taken from the data
        (the next step starts where it should), the EMA copies updated, the skips noted."""
        if self._closed:
            return
        self._closed = True
        if self._left is not None or not self._pass_done:
            raise self._left_pass("the end of the step")
        self._check_stepped()
        for micro in range(len(self._cache), self._session.ctx.batches.grad_accum):
            self._micro_batch(micro)
        self._cache.clear()
        session = self._session
        if session.cfg.dist.strategy == "fsdp":
            for entry in session.objects.models.values():
                reshard(entry.raw)  # a forward with no backward of its own (a switched-off model) may leave it gathered
        for name, entry in session.objects.models.items():
            if entry.ema is not None:
                ema_step(entry.ema, entry.raw, self._model_skipped(name))
        flags = list(self._skipped.values())
        if flags:
            session.note_skipped(self.index + 1, _any(flags))

    def _global_count(self, name: str) -> torch.Tensor:
        """The global count of optimizer ``name``'s (sum, count) losses this step, or the world size where no rank
        gave it one (a step of mean losses: its gradients then stay as they are). Made on every rank, even one whose
        micro-batches gave no (sum, count): the all-reduce is a collective, so which ranks make it cannot depend on
        their data; and read on the device, with no wait for it on the host."""
        runtime = self._session.ctx.runtime
        count = self._counts.get(name)  # a device tensor (as_token_loss's); fills below, not host copies
        took = torch.ones((), device=runtime.device) if count is not None else torch.zeros((), device=runtime.device)
        count = torch.zeros((), device=runtime.device) if count is None else count.to(runtime.device, torch.float32)
        pair = torch.stack([count.reshape(()), took])
        if runtime.distributed:
            dist.all_reduce(pair)
        return torch.where(pair[1] > 0, pair[0], torch.full_like(pair[0], float(runtime.world_size)))

    def _left_pass(self, what: str) -> Exception:
        accum = self._session.ctx.batches.grad_accum
        which = self._left or "the pass over step.micro_batches"
        return misuse(f"{what} before {which} ran its last micro-batch's backward (of {accum} micro-batches)",
                      "finish each pass, its last backward included: the gradients sync in its last micro-batch, "
                      "and a step is all of its micro-batches. To end work early when run.poll() says stop, leave "
                      "work outside the passes; the stop takes effect at the end of the step.")

    def _check_stepped(self) -> None:
        """An optimizer whose gradients only step.optimizer_step can finish (scaled by the fp16 loss scaler, or
        sums awaiting the global count) must have been stepped by it."""
        fp16 = self._session.precision.name == "fp16"
        for name, kind in self._kinds.items():
            if name not in self._skipped and (kind == "ratio" or fp16):
                why = "a (sum, count) loss" if kind == "ratio" else "a loss scaled by its fp16 GradScaler"
                raise misuse(f"optimizer '{name}' got {why} in step {self.index} but no step.optimizer_step('{name}')",
                             f"call step.optimizer_step('{name}') instead of {name}.step(): it scales the gradients "
                             "to the global count and unscales them; a plain opt.step() fits mean losses without fp16 "
                             "only.")

    def _check_own_scaler(self, name: str) -> None:
        """fp16 with several optimizers: a loss through optimizer ``name``'s scaler must reach only its models'
        gradients, or another optimizer's would be scaled by this scaler and unscaled by its own. Its pass
        (step.micro_batches(name)) switches the other models off; a model split between two optimizers cannot be."""
        session = self._session
        optimizers = session.objects.optimizers
        if len(optimizers) < 2:
            return
        if self._phase != name:
            where = {None: "outside step.micro_batches", "": "in a pass for every optimizer"}.get(
                self._phase, f"in the pass of optimizer '{self._phase}'")
            raise misuse(f"step.backward under fp16 for optimizer '{name}' {where}",
                         f"run this backward inside step.micro_batches('{name}'), which keeps the other optimizers' "
                         "models out of it.")
        mine = session.owners(name)
        shared = sorted(m for other in optimizers if other != name for m in session.owners(other) & mine)
        if shared:
            raise misuse(f"step.backward under fp16: models {shared} are stepped by optimizer '{name}' and another, "
                         "whose loss scalers differ", "step each model with one optimizer (param groups for "
                         "different settings), or train in bf16.")

    def _model_skipped(self, model: str) -> Any:
        """Whether the optimizer stepping ``model`` skipped its step (False when none stepped it this step)."""
        owners = [n for n in self._skipped if model in self._session.owners(n)]
        return _any([self._skipped[n] for n in owners]) if owners else False

    def _micro_batch(self, micro: int) -> tuple[Any, BatchInfo]:
        if micro < len(self._cache):
            return self._cache[micro]
        session = self._session
        batch = session.fetch(self._source)
        entry = (to_device(batch, session.ctx.runtime.device, session.ctx.cfg.train.channels_last_on),
                 session.batch_info(self.index, micro))
        self._cache.append(entry)
        return entry

    def _loss_owners(self, optimizer: str | None) -> list[str]:
        optimizers = self._session.objects.optimizers
        if optimizer is not None:
            if optimizer not in optimizers:
                raise misuse(f"step.backward(optimizer='{optimizer}'): no optimizer of that name is registered",
                             f"name one of {sorted(optimizers)}.")
            return [optimizer]
        if self._phase:
            return [self._phase]
        if len(optimizers) > 1 and self._session.precision.name == "fp16":
            raise misuse("step.backward under fp16 with several optimizers and no pass named",
                         "run each optimizer's backward passes in its own pass, step.micro_batches('g'): its loss "
                         "scaler and only its models' gradients.")
        return list(optimizers)

    def _only_optimizer(self, name: str | None, where: str) -> str:
        optimizers = self._session.objects.optimizers
        if name is None:
            if len(optimizers) != 1:
                raise misuse(f"{where}() without a name, with {len(optimizers)} optimizers registered",
                             f"name one of {sorted(optimizers)}.")
            return next(iter(optimizers))
        if name not in optimizers:
            raise misuse(f"{where}('{name}'): no optimizer of that name is registered",
                         f"name one of {sorted(optimizers)}.")
        return name

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise misuse(f"step.{what} after the step ended",
                         "use each step inside its own iteration of run.steps (the loop moves on to the next one).")


class _Schedules:
    """The schedulers of one optimizer, stepped together (none: nothing)."""

    def __init__(self, schedulers: list[Any]) -> None:
        self.schedulers = schedulers

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()


def _gradient_sync(model: torch.nn.Module, on: bool) -> contextlib.AbstractContextManager:
    """The model's gradient sync on or off for one micro-batch's forward and backward (train/step.py's rule)."""
    fsdp = fsdp_of(model)
    if fsdp is not None:
        fsdp.set_requires_gradient_sync(on)
        return contextlib.nullcontext()
    ddp = ddp_of(model)
    return contextlib.nullcontext() if on or ddp is None else ddp.no_sync()


def _switch_off(models: list[torch.nn.Module]) -> list[torch.Tensor]:
    """requires_grad off for the models' trainable parameters; returns those, to switch back on."""
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    return params


def _restore(params: list[torch.Tensor]) -> None:
    for p in params:
        p.requires_grad_(True)


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise misuse(f"step.log: a tensor of shape {list(value.shape)}", "log one number per name.")
        return value.detach().reshape(()).float()
    return float(value)


def _any(flags: list[Any]) -> Any:
    """Whether any of these skip flags (host bools or device tensors) is set, without reading a device one."""
    if all(isinstance(f, bool) for f in flags):
        return any(flags)
    tensors = [f if isinstance(f, torch.Tensor) else torch.tensor(float(f)) for f in flags]
    device = next(t.device for t in tensors if t.device.type != "cpu") if any(
        t.device.type != "cpu" for t in tensors) else tensors[0].device
    return torch.stack([t.to(device) for t in tensors]).amax()
