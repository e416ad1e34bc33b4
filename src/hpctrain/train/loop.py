"""The training loop. Read top to bottom: one optimizer step (its owner: train/step.py, or train/graphed.py), then
what happens after it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpctrain.checkpoint.policy import save_due
from hpctrain.dist.collectives import all_reduce_sums, broadcast_buffers, broadcast_object
from hpctrain.dist.wrap import fsdp_of, place_model
from hpctrain.errors import agreed_on_every_rank
from hpctrain.experiments.base import has_outputs, owns_optimizer
from hpctrain.fault.run_lock import lost_error
from hpctrain.fault.signals import signal_name
from hpctrain.monitor.gpu_busy import LOADER_BOUND, StepFacts, host_bound, host_bound_advice, open_meter
from hpctrain.train.context import TrainContext
from hpctrain.train.window import Window as _Window, named_stats, open_window, per_optimizer
from hpctrain.train.evaluate import evaluate
from hpctrain.train.optim import base_lr
from hpctrain.experiments.outputs import Outputs, run_outputs
from hpctrain.train.rng import capture_rng
from hpctrain.train.skips import settle_skips, skip_fields
from hpctrain.train.step_mode import graph_refusal

log = logging.getLogger("hpctrain")


@dataclass(frozen=True)
class LoopResult:
    val: dict[str, float]
    """The last validation metrics."""
    stop_signal: int
    """The signal that stopped the run early (after its checkpoint); 0 when it ran to its end."""
    val_step: int = 0
    """The step of that validation (0: none in this launch)."""


def train(ctx: TrainContext) -> LoopResult:
    """Run until ctx.end_step, or until a rank gets a stop signal; returns the last validation metrics."""
    window = begin_window(ctx)
    ctx.model.train()  # once: evaluate() puts the mode back
    last_val, val_step = catch_up(ctx)
    while ctx.state.step < ctx.end_step:
        # The sampler restarts at the saved position; set before iter() because loader
        # workers never see the sampler, only the indices it yields in this process.
        ctx.sampler.set_position(ctx.state.epoch, ctx.state.step_in_epoch)
        batches = iter(ctx.train_loader)
        window.disturbed |= bool(loader_workers(ctx.train_loader))  # its worker processes' pipeline fills again
        epoch = ctx.state.epoch
        while ctx.state.step < ctx.end_step and ctx.state.epoch == epoch:
            window.lr = base_lr(ctx.optimizer)  # the rate this step uses; the scheduler moves it after
            loss, grad_norm = ctx.stepper(ctx, batches, window)  # eager, compiled or graphed: train/step_mode.py
            ctx.state.advance(ctx.batches.global_batch_size, ctx.sampler.steps_per_epoch)
            window.add(loss, grad_norm)
            if ctx.recorder:  # hpctrain check resume: the state after this step
                ctx.recorder.record(ctx.state.step, ctx.stateful())
            val, stop_signal = after_step(ctx, window, epoch_ended=ctx.state.epoch != epoch)
            if val:
                last_val, val_step = val, ctx.state.step
            if stop_signal:
                return LoopResult(last_val, stop_signal, val_step)
    return LoopResult(last_val, 0, val_step)


def begin_window(ctx: TrainContext) -> "_Window":
    """The first log window of a launch (with the open window a stop saved), and the clock of ckpt.every_minutes."""
    if ctx.busy_meter is None:  # once per context: a benchmark calls train() once per timed window
        ctx.busy_meter = open_meter(ctx.runtime.device)
        if ctx.busy_meter.why_not and ctx.runtime.is_main:
            log.info("GPU busy (the log's gpu_busy) not measured: %s", ctx.busy_meter.why_not)
    window = _Window(ctx.state.step, ctx.busy_meter.meter)
    window.carried_loss, window.carried_steps = ctx.state.log_loss, ctx.state.log_steps  # a stop's open window
    window.carried_named, window.carried_kinds = dict(ctx.state.log_values), dict(ctx.state.log_kinds)
    ctx.fault.last_save = time.monotonic()
    return window


def catch_up(ctx: TrainContext) -> tuple[dict[str, float], int]:
    """What a stop skipped at its step, before the first step of the resumed launch: the validation (on the weights
    it saved, if this run validates), then the outputs, as after_step orders them. Returns (metrics, their step)."""
    last_val: dict[str, float] = {}
    val_step = 0
    if ctx.state.eval_pending:
        ctx.state.eval_pending = False
        if ctx.val_loader is not None:
            last_val, val_step = validate(ctx), ctx.state.step
    if ctx.state.outputs_pending:
        ctx.state.outputs_pending = False
        if has_outputs(ctx.experiment):
            make_outputs(ctx, final=ctx.state.step == ctx.total_steps)
    return last_val, val_step


def after_step(ctx: TrainContext, window: "_Window", epoch_ended: bool) -> tuple[dict[str, float] | None, int]:
    """Everything between two optimizer steps; returns (validation metrics or None, stop signal or 0)."""
    step, total, cfg, fault = ctx.state.step, ctx.total_steps, ctx.cfg, ctx.fault
    fault.heartbeat.mark("sync", step)
    verdict = fault.vote.collect()  # cast one boundary ago: the same verdict on every rank
    if verdict.lock_lost:  # another training took the run dir: nothing more is written, no checkpoint
        raise _lock_lost(ctx, fault.vote.run_lock.lost if fault.vote.run_lock is not None else "")
    leaving = step >= ctx.end_step
    if verdict.stop_signal and not leaving:
        return None, stop_with_checkpoint(ctx, window, verdict.stop_signal, eval_due(ctx, epoch_ended),
                                          outputs_due(ctx, epoch_ended))
    if log_due(ctx):
        log_train(ctx, window)
    # A stop signal at the last step: the run ends here anyway (exit 0, no requeue), but its checkpoint comes
    # before the final validation, inside the grace Slurm gives between SIGTERM and SIGKILL.
    saved_first = leaving and bool(verdict.stop_signal)
    if saved_first:
        _save(ctx, window, wait=True)
        if ctx.runtime.is_main:
            log.warning("stop signal at step %d, this launch's last: checkpoint saved, finishing normally", step)
    val = validate(ctx) if eval_due(ctx, epoch_ended) else None
    saving = not saved_first and (save_due(step, total, cfg.ckpt.every_steps) or leaving or verdict.save_due)
    if saving:
        _save(ctx, window, wait=leaving)  # the last save is waited for: a finished run exits only with it on disk
    making = outputs_due(ctx, epoch_ended)
    if making:
        make_outputs(ctx, final=step == total)
    # The next log window holds this work too: its GPU time is not the step's (no host-bound verdict on it).
    window.disturbed |= bool(val is not None or saving or making)
    if epoch_ended or leaving:
        report_skipped_samples(ctx, ctx.state.epoch - 1 if epoch_ended else ctx.state.epoch)
    if leaving:
        return val, 0  # leaving: cast nothing, so no collective is left pending
    fault.vote.cast(fault.signals.received, _time_save_due(ctx))
    return val, 0


def validate(ctx: TrainContext) -> dict[str, float]:
    """Validation at this step, recorded and logged."""
    step = ctx.state.step
    # The EMA weights are the ones a run with EMA ships, so they are the ones validated.
    model = ctx.shipped_model
    # Validate on every rank the weights the checkpoint holds (rank 0's), not each rank's own batch-norm statistics.
    broadcast_buffers(model, ctx.runtime)
    val = evaluate(ctx.experiment, model, ctx.val_loader, ctx.runtime, ctx.precision, ctx.cfg.train.channels_last_on,
                   on_batch=lambda: ctx.fault.heartbeat.mark("eval"), seed=ctx.cfg.run.seed, step=step)
    ctx.metrics.log({"step": step, "split": "val", "epoch": ctx.state.epoch, **val})
    text = ctx.experiment.describe_metrics(val) if ctx.runtime.is_main else None
    if text:
        log.info("validation at step %d:\n%s", step, text)
    return val


def _lock_lost(ctx: TrainContext, why: str) -> BaseException:
    """Every rank's error for a run dir lock that rank 0 lost; ``why`` is rank 0's (the others read the lock)."""
    if not why:
        from hpctrain.fault.run_lock import LOCK_FILE, read_owner

        try:
            holder = read_owner(Path(ctx.cfg.run_dir) / LOCK_FILE)
        except Exception:  # noqa: BLE001 - only for the message
            holder = None
        why = f"now held by {holder.describe()}" if holder is not None else "it was removed or taken over"
    return agreed_on_every_rank(lost_error(Path(ctx.cfg.run_dir), why))


def check_run_dir_lock(ctx: TrainContext) -> None:
    """Collective (control plane): rank 0 reads its run dir lock right before a checkpoint; every rank raises when
    it is no longer this run's, so no checkpoint of this run lands on another training's."""
    lock = ctx.fault.vote.run_lock
    why = broadcast_object(lock.check() if lock is not None else "", ctx.runtime)
    if why:
        raise _lock_lost(ctx, why)


def _save(ctx: TrainContext, window: "_Window", wait: bool) -> None:
    check_run_dir_lock(ctx)
    ctx.fault.heartbeat.mark("checkpoint")
    ctx.state.log_loss, ctx.state.log_steps = open_window(ctx, window)
    settle_skips(ctx)  # the train state's skip counts up to this step, for the resumed run
    ctx.checkpointer.save(ctx.state.to_dict(), ctx.stateful(), capture_rng(ctx.runtime.device), wait=wait)
    if ctx.compile_cache is not None:
        ctx.compile_cache.save()  # rank 0, when it grew: what a requeued launch on another node loads
    ctx.fault.heartbeat.mark("sync")  # out of the checkpoint phase: its control-plane limit must not cover what follows
    ctx.fault.last_save = time.monotonic()


def outputs_due(ctx: TrainContext, epoch_ended: bool) -> bool:
    if not has_outputs(ctx.experiment):
        return False  # no hook: not even the barrier after it
    step, log_cfg = ctx.state.step, ctx.cfg.log
    by_steps = log_cfg.outputs_every_steps and step % log_cfg.outputs_every_steps == 0
    by_epochs = epoch_ended and log_cfg.outputs_every_epochs and ctx.state.epoch % log_cfg.outputs_every_epochs == 0
    return bool(step == ctx.total_steps or by_steps or by_epochs)


def make_outputs(ctx: TrainContext, final: bool) -> None:
    """The experiment's outputs hook on every rank (sampling split across them), with the shipped weights."""
    hb = ctx.fault.heartbeat
    hb.mark("outputs")
    model = ctx.shipped_model
    broadcast_buffers(model, ctx.runtime)  # every rank samples from rank 0's weights, as validation does
    if fsdp_of(model) is not None:
        model = unsharded_copy(ctx, model)
    out = Outputs(ctx.runtime, ctx.state.step, ctx.state.epoch, final, ctx.cfg.run.seed, Path(ctx.cfg.run_dir),
                  ctx.metrics, beat=lambda: hb.mark("outputs"), autocast=ctx.precision.autocast)
    run_outputs(ctx.experiment.outputs, model, out)
    hb.mark("sync")


def unsharded_copy(ctx: TrainContext, model: torch.nn.Module) -> torch.nn.Module:
    """A plain copy of a sharded model's weights on the device, for the experiment's outputs hook, whose ranks make
    different numbers of model calls (each call of the sharded model is a collective). Costs the full weights once
    per rank while the hook runs (not gradients or optimizer state); freed after it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # all-gathers, every rank
    with torch.random.fork_rng(devices=[]):  # building initialises weights from torch's stream: leave it as it was
        plain = place_model(ctx.experiment.build_model(), ctx.cfg, ctx.runtime)
    plain.load_state_dict(weights)
    return plain


def eval_due(ctx: TrainContext, epoch_ended: bool) -> bool:
    step, every = ctx.state.step, ctx.cfg.eval.every_steps
    return ctx.val_loader is not None and (step == ctx.total_steps or (every and step % every == 0) or (not every and epoch_ended))


def stop_with_checkpoint(ctx: TrainContext, window: "_Window", stop_signal: int, skipped_eval: bool,
                         skipped_outputs: bool = False) -> int:
    """A stop signal: the checkpoint first and nothing that resuming does not need. Slurm's grace after
    SIGTERM (KillWait) is often 30 s, and a validation pass or a plot before the save can outlast it."""
    if log_due(ctx):
        log_train(ctx, window)
    # Otherwise no record: the checkpoint holds the open window (_save), which the resumed run continues, so its
    # records equal an uninterrupted run's. In it too: the resumed run validates this step and makes its outputs first.
    ctx.state.eval_pending, ctx.state.outputs_pending = skipped_eval, skipped_outputs
    _save(ctx, window, wait=True)  # the job exits only with it on disk
    ctx.metrics.log({"step": ctx.state.step, "split": "stop", "epoch": ctx.state.epoch,
                     "signal": signal_name(stop_signal)})  # where the report marks the stop
    skipped = [what for what, due in (("validation", skipped_eval), ("outputs", skipped_outputs)) if due]
    if skipped and ctx.runtime.is_main:
        log.warning("%s due at step %d skipped: stopping (the resumed run catches up at step %d first)",
                    " and ".join(skipped), ctx.state.step, ctx.state.step)
    report_skipped_samples(ctx, ctx.state.epoch)
    return stop_signal


def _time_save_due(ctx: TrainContext) -> bool:
    """Rank 0's clock decides for all (through the vote): clocks of different nodes disagree."""
    minutes = ctx.cfg.ckpt.every_minutes
    return ctx.runtime.is_main and minutes > 0 and time.monotonic() - ctx.fault.last_save >= minutes * 60


def report_skipped_samples(ctx: TrainContext, epoch: int) -> None:
    """With data.on_error=skip: how many unreadable samples all ranks left out since the last report
    (a collective, so only in that mode: the config is the same on every rank)."""
    if ctx.cfg.data.on_error != "skip":
        return
    mine = ctx.train_loader.take_skipped() + (ctx.val_loader.take_skipped() if ctx.val_loader is not None else [])
    total = int(all_reduce_sums({"n": float(len(mine))}, ctx.runtime)["n"])
    if mine:
        log.warning("skipped %d unreadable sample(s) on this rank, e.g. %s", len(mine), mine[0])
    if total and ctx.runtime.is_main:
        log.warning("epoch %d: %d unreadable sample(s) skipped on all ranks (data.on_error=skip)", epoch, total)
    if total:
        ctx.metrics.log({"step": ctx.state.step, "split": "data", "epoch": epoch, "skipped_samples": total})


def log_due(ctx: TrainContext) -> bool:
    """A train record at this step: every log.every_steps and at the run's last step. Not at the end of a launch
    before that (train.stop_at_step) nor at a stop: windows stay aligned across a resume (the checkpoint holds the
    open one)."""
    return ctx.state.step % ctx.cfg.log.every_steps == 0 or ctx.state.step == ctx.total_steps


def log_train(ctx: TrainContext, window: "_Window") -> None:
    """The logged loss is the mean over all ranks and all steps since the last log: one all-reduce, only here."""
    # This rank's GPU since the window began; a window with more than training steps in it has no number.
    busy = window.busy.read() if window.busy is not None else None
    busy = None if window.disturbed or window.first_step == window.launch_step else busy
    if window.busy is not None and window.busy.silent() and ctx.runtime.is_main:
        log.info("GPU busy (gpu_busy) not measured: NVML has given no utilisation samples for this GPU in %d log "
                 "windows (a MIG instance has none)", window.busy.empty_reads)
    # A resumed run's open window: counted once (rank 0), weighed as the uninterrupted run's ranks would weigh it.
    carried = ctx.runtime.world_size if ctx.runtime.is_main else 0
    stats = {"loss": window.loss_sum, "n": float(window.steps), "wait": window.data_wait,
             "busy": busy or 0.0, "busy_n": float(busy is not None),
             "carried_loss": carried * window.carried_loss, "carried_n": float(carried * window.carried_steps)}
    sums = all_reduce_sums(stats | named_stats(ctx, window, float(carried)), ctx.runtime)
    now = time.perf_counter()
    elapsed = now - window.started
    wait_frac = sums["wait"] / ctx.runtime.world_size / elapsed
    steps = ctx.state.step - window.first_step
    record: dict[str, Any] = {"step": ctx.state.step, "split": "train", "epoch": ctx.state.epoch}
    if sums["n"] + sums["carried_n"]:  # an Experiment's one loss (a multi-model step logs named values instead)
        record["loss"] = (sums["loss"] + sums["carried_loss"]) / (sums["n"] + sums["carried_n"])
    for name in sorted(window.carried_kinds | window.kinds):
        den = sums[f"{name}\0den"]
        record[name] = sums[f"{name}\0num"] / den if den else float("nan")
    record |= per_optimizer("lr", window.lrs) if window.lrs else {"lr": window.lr}
    record |= {
        "samples_per_s": steps * ctx.batches.global_batch_size / elapsed,
        "eta_s": (ctx.total_steps - ctx.state.step) * elapsed / max(steps, 1),
        "data_wait_frac": wait_frac,
    }
    if sums["busy_n"]:
        record["gpu_busy"] = sums["busy"] / sums["busy_n"]  # the mean over the ranks that measured
    _warn_if_loader_bound(ctx, window, wait_frac)
    _warn_if_host_bound(ctx, window, wait_frac, record.get("gpu_busy"))
    if window.grad_norm is not None:
        record["grad_norm"] = float(window.grad_norm)
    record |= per_optimizer("grad_norm", {k: float(v) for k, v in window.grad_norms.items()})
    record |= skip_fields(ctx)  # the steps skipped for a non-finite gradient, when any
    ctx.metrics.log(record)
    window.reset(ctx.state.step)


def _warn_if_loader_bound(ctx: TrainContext, window: "_Window", wait_frac: float) -> None:
    # The first window after a (re)start holds the workers' start-up and the first prefetch: not evidence.
    if wait_frac < LOADER_BOUND or window.first_step == window.launch_step or window.warned_loader_bound:
        return
    window.warned_loader_bound = True
    if ctx.runtime.is_main:
        log.warning("the data loader limits the step time: ranks wait %.0f%% of it for batches. %s", 100 * wait_frac,
                    loader_advice(ctx.train_loader))


def _warn_if_host_bound(ctx: TrainContext, window: "_Window", wait_frac: float, busy: float | None) -> None:
    if window.warned_host_bound or not host_bound(busy, wait_frac):  # busy: None for a disturbed window
        return
    window.warned_host_bound = True
    if ctx.runtime.is_main:
        advice = host_bound_advice(step_facts(ctx))
        log.warning("the host limits the step time: the GPU ran kernels %.0f%% of it (NVML's utilisation, the mean "
                    "of the ranks' GPUs) and the loader did not hold it up. %s", 100 * busy, advice)


def step_facts(ctx: TrainContext) -> StepFacts:
    """What the run's step is and could be, for the host-bound advice."""
    stepper, cfg = ctx.stepper, ctx.cfg
    failed = getattr(stepper, "failed", "")
    replaying = getattr(stepper, "graph", None) is not None and not failed
    mode = "graphed" if replaying else "compiled" if cfg.train.compiled else "eager"
    graphable = ctx.experiment is not None and ctx.experiment.graphable
    refusal = failed or graph_refusal(cfg, ctx.runtime, ctx.precision, graphable,
                                      owns_optimizer(type(ctx.experiment))) or ""
    return StepFacts(mode, refusal, ctx.runtime.distributed, cfg.dist.strategy != "fsdp", ctx.batches.grad_accum,
                     ctx.batches.micro_batch_size, cfg.data.on_device)


def loader_workers(loader) -> int | None:
    """The loader's worker processes, through its wrappers (SkipCountingLoader, a benchmark's); None for
    data.on_device's DeviceLoader (no loader processes)."""
    while loader is not None:
        workers = getattr(loader, "num_workers", None)
        if workers is not None:
            return workers
        loader = getattr(loader, "loader", None)
    return None


def loader_advice(loader) -> str:
    """What to try, from what the loader is: more workers help a data set that reads and decodes; an in-memory one
    is slowed by workers (pickling and a pipe per batch), and raising them makes it worse."""
    from hpctrain.data.loader import in_memory

    workers = loader_workers(loader)
    if workers is None:  # data.on_device: batches are cut from the data on the device, no loader processes
        return ("With data.on_device=true the batches are cut on the device: the wait is the device transform's or "
                "the host's launching of it, not loading.")
    dataset = getattr(loader, "dataset", None)
    raw = getattr(dataset, "base", dataset)  # KeyedDataset wraps the experiment's own
    if raw is not None and in_memory(raw):
        if workers:
            return (f"The data set is in memory and data.num_workers={workers}: set data.num_workers=0 (worker "
                    "processes only add pickling and a pipe per batch), or data.on_device=true to keep it on the GPU.")
        return ("The data set is in memory: the per-batch work is the transform's (make it cheaper, or batch it on "
                "the device with data.on_device=true).")
    return (f"With data.num_workers={workers}: raise it (CPUs per process: slurm.cpus_per_task), pre-resize images "
            "(hpctrain shard --resize), or decode on the GPU.")
