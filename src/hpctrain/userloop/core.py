"""The training session: what hpctrain owns around a step or a loop the user writes.

One object per process (``run`` in ``with hpctrain.session() as run``, and what a StepExperiment's step runs in):
the process group and device (given), the run dir lock, the stop signals, the heartbeat and the hang watchdog,
model wrapping per dist.strategy, the registry of everything a checkpoint holds, the exact data order, the
step-boundary vote, checkpoints, the train records and validation. Its loop (``steps``) is train/loop.py's: each
boundary is the same after_step an Experiment's run goes through (vote, records, checkpoints, validation and outputs
where an experiment has them), so a user's loop stops, saves, logs and resumes as hpctrain train does.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from hpctrain.checkpoint.manager import Checkpointer
from hpctrain.config.batch import batch_sizes
from hpctrain.config.schema import RunConfig
from hpctrain.data.loader import build_loader
from hpctrain.data.sampler import EvalBatchSampler, StepBatchSampler
from hpctrain.dist.collectives import barrier, value_range
from hpctrain.dist.env import fault_injection_spec
from hpctrain.dist.runtime import Runtime
from hpctrain.dist.wrap import broadcast_module, place_model, unwrap_model, wrap_model
from hpctrain.experiments.base import Datasets, Experiment, default_fsdp_blocks
from hpctrain.fault.alerts import Alerter, resolve_webhook
from hpctrain.fault.heartbeat import Heartbeat
from hpctrain.fault.inject import build_injector
from hpctrain.fault.signals import StopSignals, stop_signal_names
from hpctrain.fault.vote import StepVote
from hpctrain.process_exit import exit_code_of
from hpctrain.userloop.evaluation import evaluate_over
from hpctrain.userloop.data import OwnLoader, OwnOrder, is_map_style, own_data_warning
from hpctrain.userloop.objects import NamedObjects, Wrapped, agreed_misuse, misuse
from hpctrain.userloop.step import Step
from hpctrain.train import loop
from hpctrain.train.context import FaultState, TrainContext
from hpctrain.train.ema import build_ema
from hpctrain.train.optim import base_lr, rebuilt_for_zero
from hpctrain.train.precision import resolve_precision
from hpctrain.train.resume_record import ResumeRecorder
from hpctrain.train.rng import seed_everything, seed_rank_streams
from hpctrain.train.ending import conclude
from hpctrain.train.guard import failed, start_watchdog
from hpctrain.train.run import check_strategy, fsdp_param_dtype, start_run, train_order
from hpctrain.train.rundir import prepare_run_dir
from hpctrain.train.skips import SkipLedger
from hpctrain.train.state import TrainState
from hpctrain.train.step import batch_info

log = logging.getLogger("hpctrain")


class Stopped(BaseException):
    """The ranks agreed to stop at a step boundary, and the checkpoint is saved: the loop ends here (a
    BaseException, so a user's ``except Exception`` around a step does not swallow the stop)."""

    def __init__(self, result: loop.LoopResult) -> None:
        super().__init__(f"stopped by signal {result.stop_signal}")
        self.result = result


class _Stepper:
    """What the loop's boundary code reads of a step's owner (train/skips.py's ledger)."""

    mode = "eager"

    def __init__(self) -> None:
        self.skips = SkipLedger()


class _Scalers:
    """The optimizers' loss scalers as one, for the skip ledger (train/skips.py): an fp16 step skipped while any
    scaler is still at work is a loss-scale backoff, not divergence."""

    def __init__(self, scalers: dict[str, torch.amp.GradScaler]) -> None:
        self.scalers = scalers

    def is_enabled(self) -> bool:
        return any(s.is_enabled() for s in self.scalers.values())

    def get_scale(self) -> float:
        return min(s.get_scale() for s in self.scalers.values() if s.is_enabled())


class TrainingSession:
    def __init__(self, cfg: RunConfig, runtime: Runtime, config_text: str, experiment: Experiment | None = None,
                 lock: Any = None) -> None:
        if cfg.train.step_mode == "graphed":
            raise misuse("train.step_mode=graphed: a step written by the user is not captured as a CUDA graph",
                         "use train.step_mode=auto, eager or compiled.")
        self.cfg = cfg
        self.runtime = runtime
        self.config_text = config_text
        self.experiment = experiment
        self.lock = lock
        self.precision = resolve_precision(cfg.train.precision, runtime.device)
        check_strategy(cfg, runtime, self.precision)
        self.objects = NamedObjects()
        self.fault = FaultState(signals=StopSignals(), vote=StepVote(runtime), heartbeat=Heartbeat(
            runtime.rank, runtime.hostname, on_mark=build_injector(fault_injection_spec(), runtime.rank)))
        self.fault.vote.run_lock = lock
        self.steps_schedules = experiment is not None
        """step.optimizer_step steps the optimizer's schedulers: a StepExperiment's, which hpctrain built; a user's
        loop steps its own."""
        self.applied: dict[str, bool] = {}
        """Per optimizer: a step of this launch has updated its weights (train/skips.py flag_reader)."""
        self.ctx: TrainContext | None = None
        self.window: Any = None
        self.result: loop.LoopResult | None = None
        self.exit_code = 0
        """After the session: 0 done, fault.exit_code stopped by a signal (resume me), 130 stopped by Ctrl-C."""
        self.recorder = ResumeRecorder.from_environment(runtime.rank)
        self._steps: Steps | None = None
        self._data: Any = None
        self._open = False
        self.eval_loaders: dict[int, Any] = {}
        """run.evaluate's loader of each validation set (by id), made at its first call."""
        self._owners: dict[str, set[str]] = {}
        self.current: Step | None = None
        """The step the user's loop is in (between its start and its close), or None."""
        self.ratio_optimizers: set[str] = set()
        """The optimizers that took a (sum, count) loss in some step: from then on every rank all-reduces their
        count at each of their steps, whatever its own micro-batches gave."""
        seed_everything(cfg.run.seed)  # the same initial weights on every rank, as an Experiment's run has

    # -- the session's life ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def opened(self) -> Iterator["TrainingSession"]:
        """The signals, watchdog and alerts around the user's work; afterwards ``exit_code`` says how it ended."""
        cfg, runtime = self.cfg, self.runtime
        alerter = Alerter(resolve_webhook(cfg.alert), cfg.alert, cfg.run_name, cfg.run_dir, runtime.job_id,
                          runtime.rank)
        self.fault.signals.install(stop_signal_names(cfg.fault.warning_signal))
        if runtime.is_main:
            prepare_run_dir(Path(cfg.run_dir))
        barrier(runtime)
        watchdog = start_watchdog(cfg, runtime, self.fault, alerter, lambda: self.ctx.state.step if self.ctx else 0)
        started = time.perf_counter()
        self._open = True
        try:
            yield self
            result = self.result or loop.LoopResult({}, 0)
        except Stopped as stop:
            result = stop.result
        except BaseException as raised:
            if isinstance(raised, SystemExit) and exit_code_of(raised) == 0:  # the user's own clean end
                self.fault.signals.uninstall()
                watchdog.stop("done")
                raise
            err = failed(raised, self.fault, watchdog, alerter, self.ctx.state.step if self.ctx else 0, runtime)
            if err is not raised:
                raise err from None
            raise
        finally:
            self._open = False
            if self.ctx is not None:
                self.ctx.checkpointer.drain()  # a background write ends before the run dir lock is released
                self.ctx.metrics.close()
            self.recorder.close()
        if self.ctx is None:  # no training step was asked for
            watchdog.stop("done")
            self.fault.signals.uninstall()
            return
        self.exit_code = conclude(self.ctx, result, watchdog, alerter, started).exit_code

    def _usable(self, what: str) -> None:
        if not self._open:
            raise misuse(f"run.{what} outside its session", "use the run only inside `with hpctrain.session() as run:`.")

    # -- what the user registers ----------------------------------------------------------------------------------

    def wrap(self, obj: Any, *, ema: float = 0.0, blocks: list[nn.Module] | None = None) -> Any:
        """A model placed on this rank's device and wrapped per dist.strategy (DDP, FSDP2 sharded per ``blocks``,
        default default_fsdp_blocks; compiled under train.compile), with an EMA copy of decay ``ema`` when > 0.
        A model without trainable parameters (a frozen teacher) is placed only. An optimizer: as dist.strategy=zero1
        runs it (ZeroRedundancyOptimizer), else unchanged. Register what it returns."""
        self._usable("wrap")
        if self._steps is not None:
            raise misuse("run.wrap after run.steps", "wrap every model before asking for the steps.")
        if isinstance(obj, torch.optim.Optimizer):
            zero = self.cfg.dist.strategy == "zero1" and self.runtime.distributed
            return rebuilt_for_zero(obj, "run.wrap") if zero else obj
        if not isinstance(obj, nn.Module):
            raise misuse(f"run.wrap got a {type(obj).__name__}", "wrap torch.nn.Module models (and optimizers).")
        if self.objects.known_module(obj):
            raise misuse(f"run.wrap: this {type(obj).__name__} is wrapped already",
                         "wrap each model once, and use what run.wrap returned.")
        trainable = any(p.requires_grad for p in obj.parameters())
        if ema and not trainable:
            raise misuse("run.wrap(..., ema=...) of a model without trainable parameters",
                         "keep an EMA of a model that trains.")
        placed = place_model(obj, self.cfg, self.runtime)
        copy = build_ema(placed, ema) if ema > 0 else None
        wrapped = placed
        if not trainable and self.runtime.distributed:  # no DDP to broadcast rank 0's weights (loaded there alone)
            broadcast_module(placed, self.runtime)
        if trainable:
            wrapped = wrap_model(placed, self.cfg, self.runtime,
                                 blocks=blocks if blocks is not None else default_fsdp_blocks(placed),
                                 companions=(copy.module,) if copy is not None else (),
                                 param_dtype=fsdp_param_dtype(self.precision, self.runtime))
        self.objects.add_wrapped(Wrapped(unwrap_model(wrapped), wrapped, copy, trainable))
        return wrapped

    def register(self, **objects: Any) -> None:
        """Everything a checkpoint must hold, by name: the models run.wrap returned, optimizers, schedulers, and any
        object with state_dict() and load_state_dict(). Before the loop starts; a resume needs the same names."""
        self._usable("register")
        if self._steps is not None and self._steps.started:
            raise misuse("run.register after the loop started", "register everything before iterating run.steps.")
        zero = self.cfg.dist.strategy == "zero1" and self.runtime.distributed
        for name, obj in objects.items():
            self.objects.register(name, obj, self.precision.build_scaler())
            if zero and isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, ZeroRedundancyOptimizer) \
                    and self.runtime.is_main:
                log.warning("optimizer '%s' is registered as it is under dist.strategy=zero1: every rank holds its "
                            "whole state; for ZeRO-1 register %s = run.wrap(%s)", name, name, name)

    def ema_model(self, model: nn.Module) -> nn.Module:
        """The EMA copy of a wrapped model (run.wrap(model, ema=...)): what to validate or sample with."""
        for entry in [*self.objects.models.values(), *self.objects.pending.values()]:
            if model is entry.wrapped or model is entry.raw:
                if entry.ema is None:
                    raise misuse("run.ema_model of a model wrapped without ema", "wrap it with run.wrap(model, ema=...).")
                return entry.ema.module
        raise misuse("run.ema_model of a model run.wrap did not make", "pass what run.wrap returned.")

    # -- the loop --------------------------------------------------------------------------------------------------

    def steps(self, data: Any, *, collate_fn: Callable | None = None, transform: Callable | None = None,
              val: Any = None) -> "Steps":
        """The run's optimizer steps over ``data`` (see userloop/data.py): ``total`` and ``steps_per_epoch`` are known
        at once (for a schedule); iterating restores the registered objects from the run's checkpoint, yields a
        Step per optimizer step, and at every boundary votes, logs, saves and, when the ranks agreed to stop,
        saves and ends the process (exit fault.exit_code, or 130 after Ctrl-C). Once per session."""
        self._usable("steps")
        if self._steps is not None:
            raise misuse("run.steps called twice", "one run.steps per session: its loop runs the whole training "
                         "(train.max_steps or train.epochs); resumes continue it.")
        self._data = data
        self.ctx = self._context(data, collate_fn, transform, val)
        self._steps = Steps(self)
        return self._steps

    def _context(self, data: Any, collate_fn: Callable | None, transform: Callable | None, val: Any) -> TrainContext:
        cfg, runtime = self.cfg, self.runtime
        if cfg.data.on_device:
            raise misuse("data.on_device=true in a loop of your own or a StepExperiment",
                         "set data.on_device=false: run.steps takes its micro-batches from hpctrain's loader.")
        plan = batch_sizes(cfg.train.global_batch_size, cfg.train.micro_batch_size, runtime.world_size)
        seed_rank_streams(cfg.run.seed, runtime.rank)  # after the models' initial weights, as an Experiment's run
        if is_map_style(data):
            order = train_order(cfg, runtime, Datasets(train=data), plan)
            sampler: Any = StepBatchSampler(len(data), plan, runtime.rank, cfg.run.seed, order=order)
            loader: Any = build_loader(data, sampler, cfg.data, runtime, collate_fn=collate_fn, seed=cfg.run.seed,
                                       transform=transform if cfg.data.augment else None)
        else:
            if transform is not None or collate_fn is not None:
                raise misuse("run.steps(transform=/collate_fn=) with an iterable of its own",
                             "apply them in your own DataLoader, or pass a map-style data set.")
            sampler = OwnOrder(data, plan, cfg.train.max_steps)
            loader = OwnLoader(sampler)
            self._same_epochs_everywhere(sampler.steps_per_epoch)
            if runtime.is_main:
                log.warning("%s", own_data_warning(data))
        val_loader = None
        if val is not None and self.experiment is None:
            raise misuse("run.steps(val=...) in a loop of your own", "validate with run.evaluate(stats, val_set) "
                         "where step.eval_due says so.")
        if val is not None:
            batch = cfg.eval.micro_batch_size or 2 * cfg.train.micro_batch_size
            val_loader = build_loader(val, EvalBatchSampler(len(val), batch, runtime.rank, runtime.world_size,
                                                            pad=cfg.dist.strategy == "fsdp" and runtime.distributed),
                                      cfg.data, runtime, collate_fn=collate_fn)
        checkpointer = Checkpointer(Path(cfg.run_dir), cfg.experiment, runtime, self.config_text, cfg.ckpt.keep_last,
                                    cfg.ckpt.async_save, cfg.dist.strategy, cfg.dist.control_timeout_s)
        if self.lock is not None:
            checkpointer.commit_allowed = self.lock.check
        return TrainContext(
            cfg=cfg, runtime=runtime, experiment=self.experiment, batches=plan, model=None, raw_model=None,
            optimizer=None, scheduler=None, scaler=_Scalers(self.objects.scalers), ema=None, precision=self.precision,
            sampler=sampler, train_loader=loader, val_loader=val_loader,
            state=TrainState(global_batch_size=cfg.train.global_batch_size, data_order=cfg.data.order),
            total_steps=cfg.train.max_steps or cfg.train.epochs * sampler.steps_per_epoch,
            checkpointer=checkpointer, fault=self.fault, stepper=_Stepper(), objects=self.objects,
            recorder=self.recorder)

    def _same_epochs_everywhere(self, steps_per_epoch: int) -> None:
        """Collective: every rank's own data must give the same number of steps per epoch, or the ranks would end
        their epochs, save and stop at different steps (one waiting in a collective the others never make)."""
        fewest, most = value_range(steps_per_epoch, self.runtime)
        if fewest != most:
            raise agreed_misuse(f"run.steps: the ranks' own data give {int(fewest)} to {int(most)} steps per epoch "
                                f"(this rank: {steps_per_epoch})",
                                "give every rank data of the same length (e.g. a DistributedSampler with "
                                "drop_last=True), or a map-style data set, which hpctrain deals out itself.")

    def iterate(self) -> Iterator[Step]:
        """The loop of run.steps (train/loop.py's train(), with the step handed to the user)."""
        ctx = self.ctx
        self.objects.check()
        registered = [name for name, obj in self.objects.others.items() if obj is self._data]
        if registered:
            raise misuse(f"run.steps over the object registered as '{registered[0]}'", "do not register the data "
                         "you give run.steps: a registered object's state is rank 0's, loaded on every rank, and "
                         "run.steps finds the position of a resume itself.")
        for kind, optimizer in self.objects.unregistered_schedulers() if self.runtime.is_main else ():
            log.warning("a %s of optimizer '%s' is not registered: a resume would start its schedule again; "
                        "run.register(name=scheduler)", kind, optimizer)
        self._owners = {name: set(self.objects.optimizer_models(name)) for name in self.objects.optimizers}
        start_run(ctx, self.config_text, "")
        self.window = window = loop.begin_window(ctx)
        last_val, val_step = loop.catch_up(ctx)
        while ctx.state.step < ctx.end_step:
            ctx.sampler.set_position(ctx.state.epoch, ctx.state.step_in_epoch)
            batches = iter(ctx.train_loader)
            window.disturbed |= bool(loop.loader_workers(ctx.train_loader))
            epoch = ctx.state.epoch
            while ctx.state.step < ctx.end_step and ctx.state.epoch == epoch:
                window.lrs = {name: base_lr(o) for name, o in self.objects.optimizers.items()}
                step = self.current = Step(self, batches, ctx.state.step, epoch)
                ctx.fault.heartbeat.mark("step", ctx.state.step)
                try:
                    yield step
                    step.close()
                except GeneratorExit:  # the user's loop left with break (or return): no boundary, no save
                    if self.runtime.is_main:
                        log.warning("the loop over run.steps ended at step %d of %d before its end: nothing is saved "
                                    "after the last checkpoint (end a run with train.max_steps or "
                                    "train.stop_at_step instead, which save)", ctx.state.step, ctx.end_step)
                    raise
                finally:
                    self.current = None
                window.named_steps += 1
                ctx.state.advance(ctx.batches.global_batch_size, ctx.sampler.steps_per_epoch)
                if self.recorder:  # hpctrain check resume: the state after this step
                    self.recorder.record(ctx.state.step, ctx.stateful())
                val, stop_signal = loop.after_step(ctx, window, epoch_ended=ctx.state.epoch != epoch)
                if val:
                    last_val, val_step = val, ctx.state.step
                if stop_signal:
                    raise Stopped(loop.LoopResult(last_val, stop_signal, val_step))
        self.result = loop.LoopResult(last_val, 0, val_step)

    # -- what a Step asks of the session ----------------------------------------------------------------------------

    def fetch(self, batches: Iterator) -> Any:
        self.fault.heartbeat.mark("data")
        waited = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            raise misuse("the data ran out inside a step", "give run.steps data whose length does not change "
                         "while it is iterated.") from None
        self.window.data_wait += time.perf_counter() - waited
        if self.recorder:
            self.recorder.saw(batch)
        return batch

    def batch_info(self, step: int, micro: int):
        return batch_info(self.ctx, step, micro)

    def phase_models(self, optimizer: str | None) -> tuple[set[str], list[nn.Module]]:
        """(the models that sync in a pass for ``optimizer``, the trainable models switched off in it)."""
        models = self.objects.models
        if optimizer is None:
            return set(models), []
        syncing = self._owners.get(optimizer) or set(self.objects.optimizer_models(optimizer))
        return syncing, [e.raw for n, e in models.items() if e.trainable and n not in syncing]

    def owners(self, optimizer: str) -> set[str]:
        return self._owners.get(optimizer, set())

    def note_skipped(self, step: int, skipped: Any) -> None:
        self.ctx.stepper.skips.note(self.ctx, step, skipped)

    def eval_due_after(self, step: Step) -> bool:
        ctx = self.ctx
        after, every = step.index + 1, self.cfg.eval.every_steps
        epoch_ends = ctx.state.step_in_epoch + 1 == ctx.sampler.steps_per_epoch
        return after == ctx.total_steps or (every and after % every == 0) or (not every and epoch_ends)

    # -- collectives the user may need ----------------------------------------------------------------------------

    def poll(self) -> bool:
        """Collective, synchronous: whether the ranks are to stop (a stop signal reached any of them). For work
        between two boundaries that can outlast the grace after a preemption signal (a long inner loop, a
        validation pass): when True, leave that work; the loop saves and stops at its next boundary."""
        self._usable("poll")
        return bool(self.fault.vote.poll(self.fault.signals.received))

    def agree(self, flag: bool) -> bool:
        """Collective: True on every rank when ``flag`` is True on any. For any decision that gates a collective
        (an extra save, an early exit of an inner loop), so no rank enters it alone."""
        self._usable("agree")
        from hpctrain.dist.collectives import all_reduce_max

        return bool(all_reduce_max({"flag": float(bool(flag))}, self.runtime)["flag"])

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label the work inside for the heartbeat: a hang report names it (phase, step, host, stack)."""
        self.fault.heartbeat.mark(name)
        try:
            yield
        finally:
            self.fault.heartbeat.mark("step")

    def autocast(self):
        """The run's autocast (train.precision) for a forward outside step.micro_batches."""
        return self.precision.autocast()

    def evaluate(self, stats: Callable[..., dict[str, Any]], data: Any, *,
                 metrics: Callable[[dict[str, Any]], dict[str, float]] | None = None, batch_size: int = 0,
                 collate_fn: Callable | None = None) -> dict[str, float]:
        """Collective, exact validation over a map-style ``data``: ``stats(batch, info)`` returns sums for one batch
        (scalars or fixed-shape tensors; ``info`` optional), hpctrain adds them over batches and ranks, and
        ``metrics(totals)`` makes the numbers (default: every ``X_sum`` over ``count``, the rest as they are). Every
        rank runs the same number of batches (short ranks run a padding batch whose sums are dropped), so wrapped
        models may be called. The record goes into metrics.jsonl at this step."""
        self._usable("evaluate")
        return evaluate_over(self, stats, data, metrics, batch_size, collate_fn)

    # -- facts ---------------------------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.runtime.rank

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    @property
    def is_main(self) -> bool:
        return self.runtime.is_main

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)


class Steps:
    """What run.steps returns: iterate it once."""

    def __init__(self, session: TrainingSession) -> None:
        self.session = session
        self.started = False

    @property
    def total(self) -> int:
        """The run's optimizer steps (train.max_steps, or train.epochs x steps_per_epoch)."""
        return self.session.ctx.total_steps

    @property
    def steps_per_epoch(self) -> int:
        return self.session.ctx.sampler.steps_per_epoch

    def __iter__(self) -> Iterator[Step]:
        if self.started:
            raise misuse("run.steps iterated twice", "iterate the steps once: for step in run.steps(data): ...")
        self.started = True
        return self.session.iterate()

    def __len__(self) -> int:
        return self.total
