"""Assemble a run from its config and the runtime, restore it, train, finish."""

from __future__ import annotations

import functools
import inspect
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from hpctrain.checkpoint.manager import Checkpointer, Resumed
from hpctrain.checkpoint.policy import select_checkpoint
from hpctrain.config.batch import batch_sizes
from hpctrain.config.schema import RunConfig
from hpctrain.data.device_loader import DeviceLoader, dataset_tensors
from hpctrain.data.loader import build_loader
from hpctrain.data.sampler import EvalBatchSampler, OrderFn, StepBatchSampler
from hpctrain.data.shard_local import RankLayout, data_order_warning, shard_local_summary
from hpctrain.dist.collectives import barrier, broadcast_object
from hpctrain.dist.env import fault_injection_spec, stdout_is_terminal
from hpctrain.dist.runtime import Runtime
from hpctrain.dist.wrap import place_model, unwrap_model, wrap_model
from hpctrain.errors import UserError, agreed_on_every_rank, on_every_rank
from hpctrain.experiments.base import Datasets, Experiment, owns_optimizer, owns_scheduler
from hpctrain.fault.alerts import Alerter, resolve_webhook
from hpctrain.fault.heartbeat import Heartbeat
from hpctrain.fault.inject import build_injector
from hpctrain.fault.run_lock import hold_run_dir
from hpctrain.fault.signals import StopSignals, stop_signal_names
from hpctrain.fault.vote import StepVote
from hpctrain.metrics.sinks import build_metrics_logger
from hpctrain.train import loop
from hpctrain.train.context import FaultState, TrainContext
from hpctrain.train.ema import build_ema
from hpctrain.train.ending import Outcome, conclude
from hpctrain.train.guard import failed, start_watchdog
from hpctrain.train.optim import experiment_optimizer, experiment_scheduler
from hpctrain.train.compile_cache import CompileCache, node_copy_removed
from hpctrain.train.choices import LaunchChoices, choose_launch, with_instance_graphable
from hpctrain.train.graphed import release_step
from hpctrain.train.step_mode import build_step, choose_step_mode
from hpctrain.train.precision import resolve_precision
from hpctrain.train.rng import restore_rng, seed_everything, seed_rank_streams
from hpctrain.train.resume_settings import apply_hyperparameters, changed_since, hyperparameters
from hpctrain.train.resume_record import ResumeRecorder
from hpctrain.train.rundir import prepare_run_dir, set_aside_records, write_config
from hpctrain.train.state import TrainState, continue_with_batch

log = logging.getLogger("hpctrain")


def build_context(
    cfg: RunConfig, runtime: Runtime, experiment: Experiment, config_text: str, write_run_dir: bool = True,
    pretrained: bool = True, choices: LaunchChoices | None = None,
) -> TrainContext:
    """``pretrained``: load the experiment's initial weights (init_weights) on a fresh start; measurements of a
    step (plan, benchmarks) leave it off, they need no weight files. ``choices``: this launch's precision and step
    mode, chosen once (run_training's); None chooses them here (measurements, tests)."""
    run_dir = Path(cfg.run_dir)
    plan = batch_sizes(cfg.train.global_batch_size, cfg.train.micro_batch_size, runtime.world_size)
    # Same seed on every rank for the model's initial weights (DDP would broadcast rank 0's
    # anyway, but a one-process run must start from the same weights as an N-process one).
    seed_everything(cfg.run.seed)
    data = experiment.build_datasets()
    # Nodes finish staging their data (data.stage_dir) at different times: wait for the slowest on the control
    # plane (dist.control_timeout_s), not in DDP's first broadcast, which would time out after dist.timeout_s.
    if cfg.data.stage_dir and runtime.is_main and runtime.distributed:
        log.info("staged here; waiting for every node's copy (at most dist.control_timeout_s=%d s)",
                 cfg.dist.control_timeout_s)
    barrier(runtime)
    model = experiment.build_model()
    if pretrained:
        init_weights(experiment, model, cfg, runtime)
    seed_rank_streams(cfg.run.seed, runtime.rank)
    sampler = StepBatchSampler(len(data.train), plan, runtime.rank, cfg.run.seed, order=train_order(cfg, runtime, data, plan))
    train_loader = _train_loader(cfg, runtime, data, sampler)
    val_loader = None
    if data.val is not None:
        eval_batch = cfg.eval.micro_batch_size or 2 * cfg.train.micro_batch_size
        val_sampler = EvalBatchSampler(len(data.val), eval_batch, runtime.rank, runtime.world_size,
                                       pad=cfg.dist.strategy == "fsdp" and runtime.distributed)
        val_loader = build_loader(data.val, val_sampler, cfg.data, runtime, collate_fn=data.collate_fn)
    precision = choices.precision if choices else resolve_precision(cfg.train.precision, runtime.device)
    check_strategy(cfg, runtime, precision)
    model = place_model(model, cfg, runtime)
    # The EMA copy is made before wrapping: FSDP2 modules refuse deepcopy, and under fsdp the copy is sharded
    # like the model (each rank averages its own shards).
    ema = build_ema(model, cfg.optim.ema_decay)
    wrapped = wrap_model(model, cfg, runtime, blocks=experiment.fsdp_blocks(model),
                         companions=(ema.module,) if ema is not None else (), param_dtype=fsdp_param_dtype(precision, runtime))
    raw = unwrap_model(wrapped)
    optimizer = experiment_optimizer(experiment, raw, cfg, runtime)
    total_steps = cfg.train.max_steps or cfg.train.epochs * sampler.steps_per_epoch
    step_choice = choices.step if choices else choose_step_mode(cfg, runtime, precision, experiment.graphable)
    if runtime.device.type == "cuda":  # process-wide; the convolutions' algorithms are chosen at their first call
        torch.backends.cudnn.benchmark = step_choice.cudnn_benchmark
    if runtime.is_main and write_run_dir:
        prepare_run_dir(run_dir)
    barrier(runtime)
    return TrainContext(
        cfg=cfg,
        runtime=runtime,
        experiment=experiment,
        batches=plan,
        model=wrapped,
        raw_model=raw,
        optimizer=optimizer,
        scheduler=experiment_scheduler(experiment, optimizer, cfg, total_steps),
        scaler=precision.build_scaler(),
        stepper=build_step(step_choice),
        step_choice=step_choice,
        ema=ema,
        precision=precision,
        sampler=sampler,
        train_loader=train_loader,
        val_loader=val_loader,
        state=TrainState(global_batch_size=cfg.train.global_batch_size, data_order=cfg.data.order),
        total_steps=total_steps,
        checkpointer=Checkpointer(run_dir, cfg.experiment, runtime, config_text, cfg.ckpt.keep_last, cfg.ckpt.async_save,
                                  cfg.dist.strategy, cfg.dist.control_timeout_s),
        recorder=ResumeRecorder.from_environment(runtime.rank),
        fault=FaultState(
            signals=StopSignals(),
            vote=StepVote(runtime),
            heartbeat=Heartbeat(runtime.rank, runtime.hostname, on_mark=build_injector(fault_injection_spec(), runtime.rank)),
        ),
    )


def train_order(cfg: RunConfig, runtime: Runtime, data, plan) -> OrderFn | None:
    """A sharded set brings its own epoch order: local windows for sequential reads with the exact order's
    guarantees, or with data.order=shard_local each rank's own shards (hpctrain.data.shard_local)."""
    order = getattr(data.train, "epoch_order", None)
    if order is None and cfg.data.stage_dir and runtime.is_main:
        log.warning("data.stage_dir=%s is set, but experiment %s reads no shards for training: nothing is staged",
                    cfg.data.stage_dir, cfg.experiment)
    if cfg.data.order == "exact":
        return order
    if order is None or "layout" not in inspect.signature(order).parameters:
        raise on_every_rank(UserError(
            f"data.order=shard_local needs a sharded training set (a ShardDataset); experiment {cfg.experiment} reads "
            "its training data another way", "write shards (hpctrain shard) and point the experiment at them, or set "
            "data.order=exact."))
    # The order is a ShardDataset's bound method (experiments' wrappers pass it on): its shard sizes, for the summary.
    sizes = getattr(getattr(order, "__self__", None), "sizes", None)
    if runtime.is_main and sizes is not None:
        log.log(*shard_local_summary(sizes, runtime.world_size))
    return functools.partial(order, layout=RankLayout(runtime.world_size, plan.per_rank))


def check_strategy(cfg: RunConfig, runtime: Runtime, precision) -> None:
    """What only the runtime knows about dist.strategy (the config checks the rest)."""
    if cfg.dist.strategy == "fsdp" and precision.dtype == torch.float16:
        raise on_every_rank(UserError(
            "dist.strategy=fsdp with fp16 (train.precision, or precision=auto on a GPU without bf16): fp16 needs loss "
            "scaling, which hpctrain does not do for sharded gradients",
            "use train.precision=bf16 (Ampere and newer) or fp32, or dist.strategy=ddp or zero1 with fp16."))
    if cfg.dist.strategy != "ddp" and not runtime.distributed and runtime.is_main:
        log.info("dist.strategy=%s on one process: nothing to shard, the model runs unwrapped (checkpoints are the "
                 "same format and resume on any number of processes)", cfg.dist.strategy)


def fsdp_param_dtype(precision, runtime: Runtime) -> torch.dtype | None:
    """Under fsdp on a GPU with bf16: gather and compute parameters in bf16, reduce gradients in fp32 (FSDP2's
    MixedPrecisionPolicy); the sharded master weights and the optimizer stay fp32."""
    return torch.bfloat16 if runtime.device.type == "cuda" and precision.dtype == torch.bfloat16 else None


def init_weights(experiment: Experiment, model: torch.nn.Module, cfg: RunConfig, runtime: Runtime) -> None:
    """The experiment's pretrained weights, when this run starts fresh (a resumed one gets its weights from the
    checkpoint, and must not need the pretrained file). Rank 0 decides and loads; DDP's constructor then
    broadcasts its parameters and buffers to every rank, so the file is read once, not by every process of 64
    nodes, and need only be where rank 0 runs. The verdict (or rank 0's error) goes to every rank, so all stop
    with the same message instead of some waiting in DDP's first broadcast for a rank that failed."""
    if type(experiment).init_weights is Experiment.init_weights:
        return
    verdict: tuple[str, str, str] = ("ok", "", "")
    if runtime.is_main:
        try:
            chosen, _ = select_checkpoint(Path(cfg.run_dir) / "checkpoints", cfg.ckpt.resume, cfg.experiment,
                                          verify_checksums=False)
            if chosen is None:
                verdict = ("loaded", experiment.init_weights(model) or "", "")
        except UserError as err:
            verdict = ("error", str(err.args[0]), err.hint)
    if runtime.distributed:
        verdict = broadcast_object(verdict, runtime)
    if verdict[0] == "error":
        raise on_every_rank(UserError(verdict[1], verdict[2]))
    if verdict[0] == "loaded" and verdict[1] and runtime.is_main:
        log.info("initial weights: %s", verdict[1])


def _train_loader(cfg: RunConfig, runtime: Runtime, data: Datasets, sampler: StepBatchSampler):
    if not cfg.data.on_device:
        transform = data.train_transform if cfg.data.augment else None
        return build_loader(data.train, sampler, cfg.data, runtime, collate_fn=data.collate_fn, seed=cfg.run.seed,
                            transform=transform)
    if cfg.data.augment and data.device_transform is None and data.train_transform is not None:
        raise on_every_rank(UserError(
            f"experiment '{cfg.experiment}' augments its data on the host (train_transform) and has no "
            "device_transform for data.on_device=true",
            "set data.augment=false, or data.on_device=false (the loader path), or give the experiment a "
            "Datasets.device_transform.",
        ))
    transform = data.device_transform if cfg.data.augment else None
    return DeviceLoader(dataset_tensors(data.train, cfg.experiment), sampler, runtime.device, cfg.run.seed,
                        transform, data.device_draws)


def run_training(cfg: RunConfig, runtime: Runtime, experiment_cls: type[Experiment], config_text: str) -> Outcome:
    """Train ``cfg`` (as the user wrote it: ``config_text`` is its TOML, saved as it is, so train.channels_last=auto
    is resolved again on each launch). The precision, step mode and memory format are chosen once (train/choices.py)
    and the experiment built once, from the resolved config. The run dir is locked first (one writer at a time:
    fault/run_lock.py), and this node's copy of the compile cache removed at the end (the run dir's packed one is
    what a later launch loads)."""
    choices = choose_launch(cfg, runtime, experiment_cls)
    experiment = experiment_cls(choices.cfg)
    choices = with_instance_graphable(choices, experiment, runtime)
    cfg = choices.cfg
    with hold_run_dir(Path(cfg.run_dir), runtime) as lock, \
            node_copy_removed(Path(cfg.run_dir), runtime.device, runtime.local_rank, cfg.train.compiled):
        return _train_holding_run_dir(choices, runtime, experiment, config_text, lock)


def _train_holding_run_dir(choices: LaunchChoices, runtime: Runtime, experiment: Experiment, config_text: str,
                           lock=None) -> Outcome:
    started = time.perf_counter()
    cfg = choices.cfg
    ctx = build_context(cfg, runtime, experiment, config_text, choices=choices)
    ctx.fault.vote.run_lock = lock  # rank 0's: a lock lost while training stops every rank (loop.after_step)
    if lock is not None:  # and a checkpoint written meanwhile (in the background writer too) is not committed
        ctx.checkpointer.commit_allowed = lock.check
    alerter = Alerter(resolve_webhook(cfg.alert), cfg.alert, cfg.run_name, cfg.run_dir, runtime.job_id, runtime.rank)
    # Installed before the (possibly long) restore: a preemption then still ends in a clean stop.
    ctx.fault.signals.install(stop_signal_names(cfg.fault.warning_signal))
    watchdog = start_watchdog(cfg, runtime, ctx.fault, alerter, lambda: ctx.state.step)
    try:
        start_run(ctx, config_text, choices.memory_format.describe())
        result = loop.train(ctx)
    except BaseException as raised:
        err = failed(raised, ctx.fault, watchdog, alerter, ctx.state.step, runtime)
        if err is not raised:
            raise err from None
        raise
    finally:
        ctx.checkpointer.drain()  # a failing run's background write ends (committed or not) before the lock is released
        ctx.metrics.close()
        ctx.recorder.close()
        release_step(ctx)
    return conclude(ctx, result, watchdog, alerter, started)


def start_run(ctx: TrainContext, config_text: str, layout: str) -> Resumed | None:
    """Collective: restore the run from its checkpoint (or start it fresh), write its config, say what it is, and
    open its metrics; returns what was resumed (None: a fresh start)."""
    cfg, runtime = ctx.cfg, ctx.runtime
    # The config wins for hpctrain's own optimizer and schedule; an experiment's own resume as torch loads them.
    config_owned = ctx.optimizer is not None and not (owns_optimizer(type(ctx.experiment))
                                                      or owns_scheduler(type(ctx.experiment)))
    built = hyperparameters(ctx.optimizer) if config_owned else []  # a restore loads the checkpoint's over them
    resumed = ctx.checkpointer.restore(cfg.ckpt.resume, ctx.stateful())
    if resumed is not None and config_owned:
        apply_hyperparameters(ctx.optimizer, ctx.scheduler, built)  # the config wins, the state is kept
    if resumed is not None:
        _restore_streams(ctx, resumed)
        ctx.state = _continue_from(ctx, resumed)
    if runtime.is_main:  # only now: a refused resume leaves the run dir's config as it was
        write_config(Path(cfg.run_dir), config_text)
        if resumed is None:
            for kept in set_aside_records(Path(cfg.run_dir)):
                log.warning("fresh start: %s held an earlier attempt's records (no checkpoint to resume); "
                            "kept as %s, this run's start anew", cfg.run_dir, kept.name)
    _announce(ctx, resumed, layout)
    if cfg.train.compiled:  # before the first compiled step: a requeued job on another node does not compile again
        ctx.compile_cache = CompileCache(Path(cfg.run_dir), runtime.device, runtime.is_main, runtime.local_rank)
        ctx.compile_cache.load()
    ctx.metrics = build_metrics_logger(cfg, runtime.is_main, ctx.total_steps, ctx.state.step, stdout_is_terminal(),
                                       durable_step=lambda: ctx.checkpointer.committed_step)
    if resumed is not None:  # where the report marks the resume (a stop by a signal has its own record)
        ctx.metrics.log({"step": ctx.state.step, "split": "resume", "epoch": ctx.state.epoch,
                         "checkpoint": resumed.path.name, "world_size": runtime.world_size,
                         "saved_world_size": resumed.saved_world_size})
    return resumed


def _restore_streams(ctx: TrainContext, resumed: Resumed) -> None:
    """This rank's random streams as saved; on another world size they are re-seeded from (seed, rank, step)."""
    if resumed.rng is not None:
        restore_rng(resumed.rng, ctx.runtime.device)
        return
    seed_rank_streams(ctx.cfg.run.seed, ctx.runtime.rank, int(resumed.info["step"]))
    if not ctx.runtime.is_main:
        return
    exact = ctx.cfg.data.order == "exact" and TrainState.from_dict(resumed.info).data_order in ("", "exact")
    log.warning(
        "resuming a run saved by %d processes on %d: %sthe per-rank random streams (dropout, noise) are re-seeded "
        "from (seed, rank, step)", resumed.saved_world_size, ctx.runtime.world_size,
        "data order and position are exact, but " if exact else "",
    )


def _continue_from(ctx: TrainContext, resumed: Resumed) -> TrainState:
    """The restored state, checked against this launch's global batch (the preflight already stopped a change
    unless ckpt.on_batch_change allows it; this catches a checkpoint the preflight did not pick)."""
    saved = TrainState.from_dict(resumed.info)
    try:
        state, warning = continue_with_batch(saved, ctx.cfg.train.global_batch_size,
                                             ctx.cfg.ckpt.on_batch_change, str(resumed.path), ctx.total_steps)
    except UserError as err:
        raise agreed_on_every_rank(err) from None  # every rank read the same state.json
    if warning and ctx.runtime.is_main:
        log.warning("%s", warning)
    order_warning = data_order_warning(state.epoch, state.step_in_epoch, saved.data_order,
                                       ctx.cfg.data.order, resumed.saved_world_size, ctx.runtime.world_size)
    if order_warning and ctx.runtime.is_main:
        log.warning("%s", order_warning)
    return replace(state, data_order=ctx.cfg.data.order)


def _announce(ctx: TrainContext, resumed, layout: str) -> None:
    if not ctx.runtime.is_main:
        return
    p, rt = ctx.batches, ctx.runtime
    log.info(
        "%s: %d process(es) on %d node(s), %s/%s, global batch %d = micro %d x %d ranks x %d accumulation, "
        "%d steps (%d per epoch)",
        ctx.cfg.run_name, rt.world_size, rt.num_nodes, rt.backend or "single", rt.device.type,
        p.global_batch_size, p.micro_batch_size, p.world_size, p.grad_accum, ctx.total_steps,
        ctx.sampler.steps_per_epoch,
    )
    if ctx.step_choice is not None:
        log.info("step: %s", ctx.step_choice.describe())
    if layout:
        log.info("layout: %s", layout)
    if resumed is not None:
        log.info(
            "resumed from %s at step %d (epoch %d, step %d of it), saved by %d process(es)",
            resumed.path, ctx.state.step, ctx.state.epoch, ctx.state.step_in_epoch, resumed.saved_world_size,
        )
        for line in changed_since(resumed.path, ctx.checkpointer.config_text, ctx.state.step):
            log.info("setting changed since the checkpoint: %s", line)
    if ctx.state.step >= ctx.total_steps:
        log.info("the run is already complete at step %d; raise train.max_steps or train.epochs to go on", ctx.state.step)
    elif ctx.state.step >= ctx.end_step:
        log.info("nothing to do: at step %d, train.stop_at_step=%d", ctx.state.step, ctx.cfg.train.stop_at_step)
