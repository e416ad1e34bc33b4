"""The digits experiment: classification, accuracy from all-reduced counts."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.experiments.base import Datasets, Experiment
from hpctrain.experiments.digits.data import random_shift, split_digits
from hpctrain.experiments.digits.model import MiniResNet


@dataclass(frozen=True, kw_only=True)
class DigitsOptions:
    width: int = 32
    """Channels of the first stage (doubled at each of the two later stages)."""
    norm: Literal["batch", "group", "none"] = "batch"
    """Normalisation layer; 'group' or 'none' make each sample independent of its batch-mates."""
    val_samples: int = 397
    """Images held out for validation (of 1,797); the split is fixed, not drawn from run.seed."""
    max_shift: int = 1
    """Augmentation: random translation by up to this many pixels."""


class DigitsExperiment(Experiment):
    """MiniResNet on scikit-learn's bundled handwritten digits (no download); metric: accuracy."""

    name = "digits"
    config_class = DigitsOptions
    main_metric = "accuracy"
    higher_is_better = True
    defaults = {
        "train.global_batch_size": 100,
        "train.micro_batch_size": 25,
        "train.epochs": 20,
        "optim.lr": 3e-3,
        "optim.warmup_steps": 20,
        "log.every_steps": 10,
        "ckpt.every_steps": 100,
    }

    def build_model(self) -> nn.Module:
        return MiniResNet(in_channels=1, num_classes=10, width=self.options.width, norm=self.options.norm)

    def build_datasets(self) -> Datasets:
        train, val = split_digits(self.options.val_samples)
        return Datasets(train=train, val=val, train_transform=partial(random_shift, max_shift=self.options.max_shift))

    def train_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def eval_stats(self, model: nn.Module, batch: Any) -> Mapping[str, torch.Tensor]:
        images, labels = batch
        logits = model(images).float()
        return {
            "loss_sum": F.cross_entropy(logits, labels, reduction="sum"),
            "correct": (logits.argmax(1) == labels).sum(),
            "count": torch.tensor(float(labels.numel())),
        }

    def metrics(self, totals: Mapping[str, float]) -> dict[str, float]:
        n = max(totals["count"], 1.0)
        return {"loss": totals["loss_sum"] / n, "accuracy": totals["correct"] / n}
