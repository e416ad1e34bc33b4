"""What an experiment implements. hpctrain owns the loop, the data order, the process
group, the checkpoints and the logs; an experiment says what the model, the data, the
loss and the metrics are.

Metrics are computed from *sufficient statistics*: ``eval_stats`` returns sums (and
counts) for one batch, hpctrain adds them over batches and ranks (one all-reduce),
and ``metrics`` turns the totals into numbers. That is what makes 1 and N processes
report the same validation metrics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

import torch
from torch import nn
from torch.utils.data import Dataset

from hpctrain.config.schema import NoModelOptions, RunConfig


@dataclass(frozen=True)
class Datasets:
    train: Dataset
    """Map-style training set; hpctrain samples it."""
    val: Dataset | None = None
    """Map-style validation set, or None."""
    train_transform: Callable[[Any, torch.Generator], Any] | None = None
    """Training augmentation ``(sample, generator) -> sample``; the generator is seeded from (seed, epoch, index).
    hpctrain calls it only when data.augment is true."""


class Experiment(ABC):
    name: ClassVar[str] = ""
    """Registry name."""
    config_class: ClassVar[type] = NoModelOptions
    """Frozen dataclass of the experiment's [model] options."""
    defaults: ClassVar[Mapping[str, Any]] = {}
    """Dotted-key defaults that replace hpctrain's for this experiment (below the TOML file and the command line)."""
    main_metric: ClassVar[str] = "loss"
    """The validation metric a report leads with."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.options = cfg.model

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model on the CPU (hpctrain moves, compiles and wraps it)."""

    @abstractmethod
    def build_datasets(self) -> Datasets:
        """Training and validation sets."""

    @abstractmethod
    def train_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean loss of one micro-batch (already on the device)."""

    def eval_stats(self, model: nn.Module, batch: Any) -> Mapping[str, torch.Tensor]:
        """Sums over one validation batch. Default: the loss, weighted by the batch size."""
        n = _batch_len(batch)
        return {"loss_sum": self.train_loss(model, batch).float() * n, "count": torch.tensor(float(n))}

    def metrics(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Metrics from statistics summed over the whole validation set (all ranks)."""
        return {"loss": totals["loss_sum"] / max(totals["count"], 1.0)}

    def artifacts(self, model: nn.Module, out_dir: Path) -> None:
        """Called on rank 0 at the end of a run with the unwrapped model (samples, predictions...)."""


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values())) if isinstance(batch, dict) else batch
    return int(first.shape[0])
