"""train.step_mode resolved (eager, compiled or graphed, and why) and the step that runs it: the choice that
train/step.py's eager step and train/graphed.py's captured one share."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hpctrain.config.schema import RunConfig
from hpctrain.dist.runtime import Runtime
from hpctrain.errors import UserError
from hpctrain.train.graphed import GraphedStep
from hpctrain.train.precision import Precision
from hpctrain.train.step import EagerStep


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


def graph_refusal(cfg: RunConfig, runtime: Runtime, precision: Precision, graphable: bool = True,
                  own_optimizer: bool = False) -> str | None:
    """Why the whole step cannot be captured here, or None when it can. ``own_optimizer``: the experiment builds its
    optimizer itself (Experiment.build_optimizer)."""
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
    if own_optimizer:
        return ("the experiment builds its own optimizer (build_optimizer): a captured step needs hpctrain's fused "
                "AdamW or SGD, which read their learning rates and the non-finite skip from device tensors")
    if cfg.optim.name not in ("adamw", "sgd"):
        return f"optim.name={cfg.optim.name} has no fused implementation to capture"
    if not graphable:
        return "the experiment sets graphable=False (its train_loss synchronises with the host)"
    return None


def choose_step_mode(cfg: RunConfig, runtime: Runtime, precision: Precision, graphable: bool = True,
                     own_optimizer: bool = False) -> StepChoice:
    """train.step_mode resolved on this rank's device. auto: graphed on CUDA where the run allows it, in one process
    (with or without gradient accumulation: its GPU test passed on an H100, 2026-11-27); else compiled when
    train.compile=true, else eager. Capture under DDP over several GPUs follows torch's recipe but has not run on
    several GPUs yet: opt-in (train.step_mode=graphed) until it has. graphed where it cannot run: an error that says
    why."""
    choice = _choose(cfg, runtime, precision, graphable, own_optimizer)
    on = cudnn_benchmark(cfg, runtime, choice.mode)
    return replace(choice, cudnn_benchmark=on, cudnn_for_graph=on and cfg.train.cudnn_benchmark == "auto")


def cudnn_benchmark(cfg: RunConfig, runtime: Runtime, mode: str) -> bool:
    """train.cudnn_benchmark resolved: auto is on for a graphed step on CUDA (fixed shapes; measured on one H100
    for DeepLabV3+ R101 at batch 96, graphed: 1,008 -> 1,106 images/s, BENCHMARKS.md), off elsewhere."""
    if runtime.device.type != "cuda":
        return False
    setting = cfg.train.cudnn_benchmark
    return setting == "on" or (setting == "auto" and mode == "graphed")


def _choose(cfg: RunConfig, runtime: Runtime, precision: Precision, graphable: bool, own_optimizer: bool) -> StepChoice:
    requested = cfg.train.step_mode
    refusal = graph_refusal(cfg, runtime, precision, graphable, own_optimizer)
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


def build_step(choice: StepChoice) -> EagerStep | GraphedStep:
    if choice.mode == "graphed":
        return GraphedStep(fallback=choice.fallback, cudnn_for_graph=choice.cudnn_for_graph)
    return EagerStep()
