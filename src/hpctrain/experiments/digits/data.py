"""scikit-learn's handwritten digits (1,797 8x8 images, shipped inside scikit-learn), split with a fixed seed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from hpctrain.errors import UserError

SPLIT_SEED = 12345  # the split is part of the dataset's definition, not of the run's seed


def digits_file() -> Path:
    """scikit-learn's own copy of the set (datasets/data/digits.csv.gz: 64 pixel values 0..16 and the label per
    row), found without importing scikit-learn: its import (SciPy included) cost each rank 1.5 s of CPU at every
    start of a run, more than reading the file."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the digits experiment needs scikit-learn (the source of its bundled dataset)",
            "pip install 'hpctrain[demo]' (or pip install scikit-learn).",
        )
    return Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    path = digits_file()
    if path.is_file():
        table = np.loadtxt(path, delimiter=",", dtype=np.float64)
        pixels, target = table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    else:  # a scikit-learn that keeps the file elsewhere: its loader
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels, target = bunch.images, bunch.target
    images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values 0..16
    labels = torch.tensor(target, dtype=torch.long)
    return images, labels


def split_digits(val_samples: int) -> tuple[TensorDataset, TensorDataset]:
    images, labels = load_digits_tensors()
    if not 0 < val_samples < len(labels):
        raise UserError(
            f"model.val_samples={val_samples} must be between 1 and {len(labels) - 1}",
            "digits has 1797 samples; the default holds out 397.",
        )
    g = torch.Generator().manual_seed(SPLIT_SEED)
    order = torch.randperm(len(labels), generator=g)
    val, train = order[:val_samples], order[val_samples:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[val], labels[val])


def random_shift(sample: tuple[torch.Tensor, torch.Tensor], gen: torch.Generator, max_shift: int = 1):
    """Translate the image by up to max_shift pixels (zero fill): digits are not centred identically."""
    image, label = sample
    dy, dx = (torch.randint(-max_shift, max_shift + 1, (2,), generator=gen)).tolist()
    padded = torch.nn.functional.pad(image, (max_shift,) * 4)
    h, w = image.shape[-2:]
    y0, x0 = max_shift + dy, max_shift + dx
    return padded[..., y0 : y0 + h, x0 : x0 + w], label
