"""Images from a run: a grid of samples as a PNG file (written whole or not at all) and as a TensorBoard image.

The grid is torchvision's make_grid; PNG encoding is Pillow's. Written here: only the atomic write and the
checks that turn a wrong tensor into a message instead of a garbled picture."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch


def image_grid(images: torch.Tensor, nrow: int = 0, padding: int = 2) -> np.ndarray:
    """N x C x H x W floats in [0, 1] (C = 1 or 3) -> one H' x W' x C uint8 array; nrow 0: a square-ish grid."""
    from torchvision.utils import make_grid

    if images.ndim != 4 or images.shape[1] not in (1, 3) or images.shape[0] == 0:
        raise ValueError(f"expected N x C x H x W images with C 1 or 3 and N >= 1, got shape {list(images.shape)}")
    if not images.is_floating_point():
        raise ValueError(f"expected floats in [0, 1], got {images.dtype} (divide uint8 images by 255)")
    n = images.shape[0]
    nrow = nrow or math.ceil(math.sqrt(n))
    grid = make_grid(images.detach().float().cpu().clamp(0, 1), nrow=nrow, padding=padding, pad_value=1.0)
    array = (grid * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return array[..., :1] if images.shape[1] == 1 else array


def write_png(path: Path, array: np.ndarray) -> Path:
    """An H x W x C (C 1 or 3) uint8 array as a PNG, through a temporary file renamed into place: a reader or a
    killed job never sees half a file."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array).save(tmp, format="PNG")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written temporary behind
        raise
    return path
