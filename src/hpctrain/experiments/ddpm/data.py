"""The DDPM experiments' images as uint8 tensors (N x C x H x W) with labels: small enough (CIFAR-10's training
set is 150 MB) to hold in memory, and on the GPU with data.on_device."""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from hpctrain.config.schema import DataSection
from hpctrain.errors import UserError


def load_images(o, data: DataSection) -> tuple[Dataset, Dataset]:
    """(train, val) for model.source; val is CIFAR-10's test split (or the held-out digits)."""
    if o.source == "cifar10":
        return _cifar10(Path(o.data_root), "train"), _cifar10(Path(o.data_root), "test")
    if o.source == "shards":
        return _shards(Path(o.data_root), "train", data), _shards(Path(o.data_root), "test", data)
    if o.source == "digits":
        return _digits(o.image_size)
    return _fixture(o.fixture_samples, o.image_size, 0), _fixture(max(o.fixture_samples // 4, 1), o.image_size, 1)


def _cifar10(root: Path, split: str) -> TensorDataset:
    from hpctrain.datasets.sources import cifar10

    cifar10.check_present(root, download_if_missing=False)
    images, labels = [], []
    for image, label, _ in cifar10.samples(root, split):
        images.append(image)
        labels.append(label)
    if not images:
        raise UserError(f"CIFAR-10 under {root} has no {split} images", "download CIFAR-10 again.")
    stacked = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()  # N x 3 x 32 x 32 uint8
    return TensorDataset(stacked, torch.tensor(labels))


def _shards(root: Path, split: str, data: DataSection) -> Dataset:
    """Shards written by `hpctrain shard --format cifar10`: PNG images and class labels. Read per sample by the
    loader (the shard path's exact order); with data.on_device the split is decoded once into memory instead."""
    from hpctrain.data.shardset import shard_dataset

    split_dir = root / split
    if not split_dir.exists():
        raise UserError(f"no shards at {split_dir}",
                        f"write them with: hpctrain shard CIFAR10_DIR {shlex.quote(str(root))} --format cifar10 (or set "
                        "model.data_root).")
    shards = shard_dataset(split_dir, ["png", "cls"], data, num_classes=10)
    if not data.on_device:
        return shards
    decoded = [shards[i] for i in range(len(shards))]  # each sample read and decoded once
    held = TensorDataset(torch.stack([image for image, _ in decoded]), torch.tensor([label for _, label in decoded]))
    held.epoch_order = shards.epoch_order  # the shard path's order (local windows), so on_device changes no batch
    return held


def _digits(size: int) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 8x8 digits, upsampled (bilinear) to size x size, as uint8: the digits demo's split."""
    from hpctrain.experiments.digits.data import split_digits

    train, val = split_digits(val_samples=397)
    return _upsampled(train, size), _upsampled(val, size)


def _upsampled(ds: TensorDataset, size: int) -> TensorDataset:
    images, labels = ds.tensors  # N x 1 x 8 x 8 floats in [0, 1]
    if size != images.shape[-1]:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    return TensorDataset((images.clamp(0, 1) * 255).round().to(torch.uint8), labels)


def _fixture(n: int, size: int, seed: int) -> TensorDataset:
    """CIFAR-like generated patterns (the test fixtures' generator): for smoke tests without CIFAR-10."""
    from hpctrain.datasets.fixtures import pattern_image

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    images = np.stack([pattern_image(rng, int(y), size) for y in labels])
    return TensorDataset(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(labels))
