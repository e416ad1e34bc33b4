"""A user experiment that trains from shards (loaded as 'tests.shard_experiment:ShardClassifier'):
a tiny classifier on CIFAR-10-format fixture shards. model.shards points at `hpctrain shard` output."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hpctrain.data.shardset import ShardDataset, shard_dataset
from hpctrain.experiments import Datasets, Experiment


@dataclass(frozen=True, kw_only=True)
class ShardOptions:
    shards: str = ""
    """Output directory of `hpctrain shard ... --format cifar10` (holds train/ and test/)."""


def to_float(sample, gen):
    image, label = sample
    flip = bool(torch.rand((), generator=gen) < 0.5)
    image = image.float() / 255.0
    return (image.flip(-1) if flip else image), label


class ShardClassifier(Experiment):
    name = "shardtoy"
    config_class = ShardOptions
    defaults = {"train.global_batch_size": 12, "train.micro_batch_size": 2, "train.max_steps": 6, "log.plots": False,
                "log.every_steps": 1, "log.tensorboard": False}

    def shard_dirs(self) -> list[str]:
        return [f"{self.options.shards}/train", f"{self.options.shards}/test"]

    def build_datasets(self) -> Datasets:
        root = Path(self.options.shards)
        train = shard_dataset(root / "train", ["png", "cls"], self.cfg.data, num_classes=10)
        val = shard_dataset(root / "test", ["png", "cls"], self.cfg.data, num_classes=10)
        return Datasets(train=train, val=_Floats(val), train_transform=to_float)

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 15 * 15, 10))

    def train_loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)


class _Floats(torch.utils.data.Dataset):
    def __init__(self, base: ShardDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        image, label = self.base[i]
        return image.float() / 255.0, label
