"""Everything the loop needs, built once by train/run.py and passed to the loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hpctrain.checkpoint.manager import Checkpointer
from hpctrain.config.batch import BatchSizes
from hpctrain.config.schema import RunConfig
from hpctrain.data.loader import SkipCountingLoader
from hpctrain.data.sampler import StepBatchSampler
from hpctrain.dist.runtime import Runtime
from hpctrain.data.device_loader import DeviceLoader
from hpctrain.experiments.base import Experiment, has_state
from hpctrain.fault.heartbeat import Heartbeat
from hpctrain.fault.signals import StopSignals
from hpctrain.fault.vote import StepVote
from hpctrain.metrics.sinks import MetricsLogger
from hpctrain.train.precision import Precision
from hpctrain.train.state import TrainState
from hpctrain.train.step import EagerStep


@dataclass
class FaultState:
    signals: StopSignals
    """Records SIGTERM and the warning signal; read at step boundaries."""
    vote: StepVote
    """The asynchronous all-rank vote on stopping and saving."""
    heartbeat: Heartbeat
    """This rank's phase and step, for the watchdog."""
    last_save: float = 0.0
    """time.monotonic() of the last checkpoint (or of the start), for ckpt.every_minutes."""


@dataclass
class TrainContext:
    cfg: RunConfig
    runtime: Runtime
    experiment: Experiment
    batches: BatchSizes
    model: nn.Module | None
    """What forward/backward run on: compiled and DDP-wrapped as configured (None: several models, in objects)."""
    raw_model: nn.Module | None
    """The plain module: checkpoints and evaluation."""
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    ema: nn.Module | None
    precision: Precision
    sampler: StepBatchSampler
    train_loader: SkipCountingLoader | DeviceLoader
    val_loader: SkipCountingLoader | None
    state: TrainState
    total_steps: int
    checkpointer: Checkpointer
    fault: FaultState
    stepper: Any = field(default_factory=EagerStep)
    """The owner of the optimizer step: train/step.py's EagerStep or train/graphed.py's GraphedStep, per
    train.step_mode."""
    compile_cache: Any = None
    """The run's torch.compile cache (train/compile_cache.py) when the model is compiled: saved after checkpoints."""
    step_choice: Any = None
    """The resolved train.step_mode and why (train/step_mode.py StepChoice), for the start-up line."""
    busy_meter: Any = None
    """monitor/gpu_busy.py's BusyMeter for this rank's GPU, opened by the loop's first call (NVML's set-up can take
    a second on a node without persistence mode)."""
    metrics: MetricsLogger = field(default_factory=lambda: MetricsLogger([]))
    """Replaced once the start step is known (after restore); silent until then."""
    recorder: Any = None
    """train/resume_record.py's ResumeRecorder when `hpctrain check resume` runs this training (else None)."""
    objects: Any = None
    """Several models, optimizers, schedulers and EMAs by name (userloop/objects.py NamedObjects: a StepExperiment's
    or a user loop's), in place of the one model, optimizer, scheduler, scaler and EMA above; None for an
    Experiment."""

    @property
    def end_step(self) -> int:
        """Where this launch stops: the run's last step, or train.stop_at_step when earlier."""
        stop = self.cfg.train.stop_at_step
        return min(self.total_steps, stop) if stop else self.total_steps

    def stateful(self) -> dict[str, Any]:
        """What a checkpoint holds besides the train state and RNG."""
        experiment = self.experiment if self.experiment is not None and has_state(self.experiment) else None
        if self.objects is not None:
            return self.objects.stateful(experiment)
        return {
            "model": self.raw_model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "ema": self.ema,
            "experiment": experiment,
        }

    @property
    def shipped_model(self) -> nn.Module:
        """The weights a run ships, validates and samples from: the EMA ones when optim.ema_decay > 0."""
        if self.objects is not None:
            return self.objects.shipped()
        return self.ema.module if self.ema is not None else self.raw_model
