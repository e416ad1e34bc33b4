"""A user experiment outside the package (loaded as 'toy_experiment:LinearToy'): linear regression
on generated data. No batch-dependent layers, no download, fast."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from hpctrain.experiments import Datasets, Experiment


@dataclass(frozen=True, kw_only=True)
class ToyOptions:
    features: int = 8
    """Input features."""
    samples: int = 512
    """Training samples."""
    unused_head: bool = False
    """Add a trainable layer the loss never uses: its parameters never get a gradient, so the optimizer never
    makes state for them (a multi-task model with a head switched off, a frozen-by-accident layer)."""


class WithUnusedHead(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, 1)
        self.unused = nn.Linear(features, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class LinearToy(Experiment):
    name = "toy"
    config_class = ToyOptions
    defaults = {"train.global_batch_size": 32, "train.micro_batch_size": 8, "train.max_steps": 6, "log.plots": False}

    def _data(self, n: int, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, self.options.features, generator=g)
        w = torch.arange(1.0, self.options.features + 1)
        return TensorDataset(x, x @ w + 0.1 * torch.randn(n, generator=g))

    def build_model(self) -> nn.Module:
        if self.options.unused_head:
            return WithUnusedHead(self.options.features)
        return nn.Linear(self.options.features, 1)

    def build_datasets(self) -> Datasets:
        return Datasets(train=self._data(self.options.samples, 1), val=self._data(61, 2))

    def train_loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x).squeeze(-1), y)
