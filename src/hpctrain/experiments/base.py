"""What an experiment implements. hpctrain owns the loop, the data order, the process
group, the checkpoints and the logs; an experiment says what the model, the data, the
loss and the metrics are.

Metrics are computed from *sufficient statistics*: ``eval_stats`` returns sums (and
counts) for one batch, scalars or tensors of any fixed shape (a confusion matrix), hpctrain
adds them over batches and ranks (one all-reduce), and ``metrics`` turns the totals into
numbers. That is what makes 1 and N processes report the same validation metrics.

Randomness that belongs to a sample (a diffusion model's timestep and noise) comes from
``BatchInfo``: drawn by position in the global batch (training) or in the validation set,
so it does not depend on the number of processes.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

import torch
from torch import nn
from torch.utils.data import Dataset

from hpctrain.config.schema import NoModelOptions, RunConfig
from hpctrain.data.positional import positional_rand, positional_randint, positional_randn

if TYPE_CHECKING:
    from hpctrain.experiments.outputs import Outputs

DRAW_BLOCK = 64
"""Per-sample draws come in blocks of this many positions, each from its own generator: a rank draws the blocks
its samples fall in (about one micro-batch's worth), whatever the global batch or the world size."""


@dataclass(frozen=True)
class Datasets:
    train: Dataset
    """Map-style training set; hpctrain samples it."""
    val: Dataset | None = None
    """Map-style validation set, or None."""
    train_transform: Callable[[Any, torch.Generator], Any] | None = None
    """Training augmentation ``(sample, generator) -> sample``; the generator is seeded from (seed, epoch, index).
    hpctrain calls it only when data.augment is true."""
    collate_fn: Callable[[list[Any]], Any] | None = None
    """Builds a batch from a list of samples (both splits); None: torch's default_collate. E.g.
    hpctrain.data.gpu_decode.collate_encoded for decoding on the GPU."""
    device_transform: Callable[[Any, torch.Tensor], Any] | None = None
    """With data.on_device: batched augmentation on the device, ``(batch, u) -> batch``, where u holds
    device_draws uniforms in [0, 1) per sample (shape B x device_draws), drawn per (seed, epoch, sample index)."""
    device_draws: int = 1
    """Uniforms per sample that device_transform receives."""


@dataclass(frozen=True)
class BatchInfo:
    """Where a batch sits, and random numbers drawn by the positions of its samples. ``split`` 'train': positions
    in the step's global batch (all ranks together), seeded by (seed, step); 'val': positions in the validation
    set, the same for every evaluation (so validation losses of different steps are comparable). With
    data.on_error=skip a shortened batch keeps its start, so the samples after a skipped one take their
    neighbours' draws."""

    split: str
    """'train' or 'val'."""
    step: int
    """Training: the optimizer step this batch belongs to (0-based). Validation: the step validated at."""
    start: int
    """Position of the batch's first sample: in the global batch (train) or in the validation set (val)."""
    total: int
    """Global batch size (train) or validation-set size (val)."""
    seed: int
    """run.seed."""

    def _draw_key(self, stream: int) -> tuple[tuple[int, ...], int]:
        if self.split == "train":
            return (self.seed, 0, self.step, stream), DRAW_BLOCK
        return (self.seed, 1, stream), DRAW_BLOCK

    def randn(self, n: int, *shape: int, stream: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
        """(n, *shape) standard normals for this batch's n samples. ``stream`` keeps draws for different purposes
        apart (e.g. 0 for timesteps, 1 for noise)."""
        parts, block = self._draw_key(stream)
        return positional_randn(self.start, n, tuple(shape), parts, block, device)

    def rand(self, n: int, *shape: int, stream: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
        """(n, *shape) uniforms in [0, 1), as randn."""
        parts, block = self._draw_key(stream)
        return positional_rand(self.start, n, tuple(shape), parts, block, device)

    def randint(self, high: int, n: int, stream: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
        """n integers in [0, high), as randn."""
        parts, block = self._draw_key(stream)
        return positional_randint(high, self.start, n, parts, block, device)


class Experiment(ABC):
    name: ClassVar[str] = ""
    """Registry name."""
    config_class: ClassVar[type] = NoModelOptions
    """Frozen dataclass of the experiment's [model] options."""
    defaults: ClassVar[Mapping[str, Any]] = {}
    """Dotted-key defaults that replace hpctrain's for this experiment (below the TOML file and the command line)."""
    main_metric: ClassVar[str] = "loss"
    """The validation metric a report leads with."""
    higher_is_better: ClassVar[bool] = False
    """Whether a larger main_metric is better (accuracy, mIoU) or a smaller one (a loss): how a sweep's report
    ranks its points."""
    graphable: ClassVar[bool] = True
    """Whether train_loss can run inside a captured CUDA graph (train.step_mode=graphed): no host synchronisation
    (.item(), a data-dependent shape), no CPU tensors, per-sample draws through BatchInfo. False: auto runs eagerly.
    Read from the class: the step mode is chosen before the experiment is built (train/choices.py)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.options = cfg.model

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "artifacts" in vars(cls):  # the rank-0-only hook this protocol had before outputs()
            warnings.warn(f"{cls.__qualname__}.artifacts() is no longer called: implement outputs(model, out), which "
                          "runs on every rank at the end of the run (out.final) and every log.outputs_every_*",
                          UserWarning, stacklevel=2)

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model on the CPU (hpctrain moves, compiles and wraps it). train.channels_last=auto inspects it on
        the meta device before the experiment is built, on an instance that has only cfg and options: a build_model
        that reads more of its class's own __init__ cannot be inspected, and the launch warns and uses NCHW (set
        train.channels_last=true or false then)."""

    def init_weights(self, model: nn.Module) -> str | None:
        """Load initial (pretrained) weights into the fresh model from build_model, on the CPU, before it is
        wrapped; a line for the log about what was loaded. Called when training starts without a checkpoint to
        resume, never by resume, sample, export or predict (their weights come from the checkpoint).
        Default: nothing."""
        return None

    @abstractmethod
    def build_datasets(self) -> Datasets:
        """Training and validation sets."""

    def shard_dirs(self) -> list[str]:
        """The shard split folders build_datasets reads, for `hpctrain slurm check` (a network filesystem, their
        size, room in data.stage_dir). Default: none, and the check says nothing about the data."""
        return []

    @abstractmethod
    def train_loss(self, model: nn.Module, batch: Any, info: BatchInfo) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The loss of one micro-batch (already on the device): its mean over the micro-batch, or a pair ``(sum,
        count)`` for a loss over a varying number of items per sample (tokens, frames): the gradient is then that
        of the sum over the whole global batch divided by its count over the whole global batch (all micro-batches,
        all ranks), the same for any micro-batch size and world size. ``info`` may be left out of the signature
        by experiments that draw nothing per sample."""

    def eval_stats(self, model: nn.Module, batch: Any, info: BatchInfo) -> Mapping[str, torch.Tensor]:
        """Sums over one validation batch, scalars or fixed-shape tensors. Default: the loss, weighted by the
        batch size."""
        n = _batch_len(batch)
        return {"loss_sum": call_train_loss(self, model, batch, info).float() * n, "count": torch.tensor(float(n))}

    def metrics(self, totals: Mapping[str, Any]) -> dict[str, float]:
        """Metrics from statistics summed over the whole validation set (all ranks): a float for each scalar
        statistic, a float64 CPU tensor for each tensor statistic."""
        return {"loss": totals["loss_sum"] / max(totals["count"], 1.0)}

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]] | None:
        """Optimizer parameter groups of ``model`` (the plain module, on its device): a list of ``{"params":
        [...], "lr_scale": float, "name": str}``, every trainable parameter in exactly one group; a group learns at
        optim.lr x lr_scale under the common schedule (e.g. 0.1 for a pretrained backbone). Biases and norm
        weights get no weight decay in any group. None (default): one group."""
        return None

    def build_optimizer(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """The experiment's own optimizer (any ``torch.optim.Optimizer``), built from ``groups``: the parameter
        groups hpctrain prepared from param_groups (each with ``params``, ``lr`` = optim.lr x lr_scale,
        ``weight_decay`` (0 for biases and norm weights), ``lr_scale`` and ``name``), on their device and wrapped
        (DTensor shards under fsdp). Override it to choose the optimizer; the config's optim.name, lr, betas,
        momentum and weight_decay are then the experiment's to read. Not overridden: hpctrain's fused AdamW or SGD
        from the config. Under dist.strategy=zero1 hpctrain rebuilds it per rank as
        ``type(opt)(params, **opt.defaults)`` inside ZeroRedundancyOptimizer. A step of an optimizer of the
        experiment's own runs eagerly (train.step_mode=auto says so; graphed is refused)."""
        raise NotImplementedError  # never called: hpctrain builds its own unless a subclass overrides this

    def build_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        """The learning-rate schedule: a ``torch.optim.lr_scheduler.LRScheduler`` of ``optimizer`` (stepped once
        per optimizer step, its state checkpointed), or a function of the step (0-based) returning the factor of
        each group's initial rate, which hpctrain runs as ``LambdaLR``. Not overridden: the config's (optim.schedule,
        warmup_steps, min_lr_ratio, poly_power)."""
        raise NotImplementedError  # never called: hpctrain builds its own unless a subclass overrides this

    def fsdp_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The modules dist.strategy=fsdp shards one by one (each all-gathers its parameters for its own forward and
        backward, so peak memory is about the sharded state plus the largest block); the root takes the rest.
        Default: ``default_fsdp_blocks`` (transformer layers, ResNet and U-Net blocks, items of nn.ModuleList)."""
        return default_fsdp_blocks(model)

    def describe_metrics(self, metrics: Mapping[str, float]) -> str | None:
        """Extra text the log shows after each validation (rank 0), e.g. a per-class table. Default: none."""
        return None

    def outputs(self, model: nn.Module, out: "Outputs") -> None:
        """Samples, pictures, predictions: called on *every* rank with the weights that ship (the EMA ones when
        optim.ema_decay > 0), every log.outputs_every_steps / log.outputs_every_epochs and at the end of the run.
        Split the work with ``out.share(n)``, collect it on rank 0 with ``out.gather(part)``, write it with
        ``out.image(...)`` (rank 0 writes; the other ranks' calls do nothing). Default: nothing."""

    def state_dict(self) -> dict[str, Any] | None:
        """Experiment state a checkpoint must hold (rank 0's is saved, every rank loads it); None: none. Plain
        values and tensors only: checkpoints are loaded with torch.load(weights_only=True)."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned."""


BLOCK_TYPES: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def default_fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost modules that are blocks: instances of BLOCK_TYPES, of torchvision's ResNet BasicBlock and
    Bottleneck, of any class named like a block (ending in Block, Layer or Bottleneck, e.g. a U-Net's ResBlock),
    or items of an nn.ModuleList; a block's own sub-blocks are not taken again. None found: the top-level children
    that hold parameters. Containers (ModuleList, ModuleDict) are looked into, never taken: they have no forward,
    so FSDP's gather before it would never run. Blocks should be of similar size: the largest one sets the memory
    of its gather."""
    blocks: list[nn.Module] = []

    def visit(module: nn.Module, in_list: bool) -> None:
        for child in module.children():
            container = isinstance(child, (nn.ModuleList, nn.ModuleDict))  # never called: FSDP's hooks would not run
            if not container and (_is_block(child) or (in_list and any(p.requires_grad for p in child.parameters()))):
                blocks.append(child)
            else:
                visit(child, container)

    visit(model, isinstance(model, nn.ModuleList))
    if not blocks:
        blocks = [c for c in model.children() if any(True for _ in c.parameters())]
    return blocks


def _is_block(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, BLOCK_TYPES) or name.endswith(("Block", "Layer", "Bottleneck"))


@functools.cache
def _takes_info(function: Callable) -> bool:
    """Whether an (unbound) train_loss/eval_stats has a third parameter besides self, model and batch.
    Cached per function: inspect.signature costs microseconds, and this is asked every micro-step."""
    params = inspect.signature(function).parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 4 or any(p.kind == p.VAR_POSITIONAL for p in params)


def call_train_loss(experiment: Experiment, model: nn.Module, batch: Any, info: BatchInfo) -> torch.Tensor:
    """train_loss with or without ``info``: experiments written before BatchInfo keep working."""
    if _takes_info(type(experiment).train_loss):
        return experiment.train_loss(model, batch, info)
    return experiment.train_loss(model, batch)  # type: ignore[call-arg]


def call_eval_stats(experiment: Experiment, model: nn.Module, batch: Any, info: BatchInfo) -> Mapping[str, torch.Tensor]:
    if _takes_info(type(experiment).eval_stats):
        return experiment.eval_stats(model, batch, info)
    return experiment.eval_stats(model, batch)  # type: ignore[call-arg]


def sums_over_count(totals: Mapping[str, Any]) -> dict[str, Any]:
    """Metrics from sums: each ``X_sum`` over ``count`` as ``X`` (``count`` itself then dropped), other statistics as
    they are."""
    count = totals.get("count")
    out: dict[str, Any] = {}
    for key, value in totals.items():
        if key == "count" and any(k.endswith("_sum") for k in totals):
            continue
        if key.endswith("_sum") and count:
            out[key[:-len("_sum")]] = value / count
        else:
            out[key] = value
    return out


def owns_optimizer(cls: type) -> bool:
    """Whether an Experiment class builds its own optimizer (overrides build_optimizer)."""
    return getattr(cls, "build_optimizer", Experiment.build_optimizer) is not Experiment.build_optimizer


def owns_scheduler(cls: type) -> bool:
    """Whether an Experiment class builds its own learning-rate schedule (overrides build_scheduler)."""
    return getattr(cls, "build_scheduler", Experiment.build_scheduler) is not Experiment.build_scheduler


def has_state(experiment: Experiment) -> bool:
    return type(experiment).state_dict is not Experiment.state_dict


def has_outputs(experiment: Experiment | None) -> bool:
    """Whether the run has an experiment whose outputs hook does something (a user's own loop has none)."""
    return experiment is not None and type(experiment).outputs is not Experiment.outputs


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values())) if isinstance(batch, dict) else batch
    return int(first.shape[0])
