"""Decoding and augmenting images on the GPU.

At GPU speed, decoding JPEGs on the CPU is often what a step waits for. This path moves
it to the device: loader workers only read bytes and draw the random crop and flip (from
the per-sample generator, so the result is the same for any number of ranks and
workers); the rank decodes the whole micro-batch at once with nvJPEG (TorchCodec's or
torchvision's batched ``decode_jpeg(..., device="cuda")``, data/image_decode.py) and crops, resizes and
flips there. Without CUDA the same functions run on the CPU, which is how they are
tested here; GPU and CPU decoders differ by a few grey levels (IDCT rounding), so
results agree within a tolerance, not bit for bit.

Use it from an experiment: ``ShardDataset(..., decode=False)``, ``train_transform=
encoded_crop_flip``, ``collate_fn=collate_encoded``, and in ``train_loss`` call
``batch.decode(device, size)``. NVIDIA DALI is not wrapped (see docs/data.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from hpctrain.data.image_decode import decode_image, decode_jpegs, is_jpeg


@dataclass(frozen=True)
class Crop:
    """A crop in fractions of the image (so it can be drawn before the image size is known) and a flip."""

    top: float
    left: float
    height: float
    width: float
    flip: bool

    def box(self, h: int, w: int) -> tuple[int, int, int, int]:
        ch, cw = max(1, round(self.height * h)), max(1, round(self.width * w))
        return min(round(self.top * h), h - ch), min(round(self.left * w), w - cw), ch, cw


FULL = Crop(0.0, 0.0, 1.0, 1.0, False)


def draw_crop(gen: torch.Generator, scale: tuple[float, float] = (0.75, 1.0), flip: bool = True) -> Crop:
    """A random square-ish crop of ``scale`` of each side, and a flip with p=0.5."""
    r = torch.rand(4, generator=gen).tolist()
    side = scale[0] + (scale[1] - scale[0]) * r[0]
    return Crop(r[1] * (1 - side), r[2] * (1 - side), side, side, flip and r[3] < 0.5)


def encoded_crop_flip(sample: tuple[Any, ...], gen: torch.Generator) -> tuple[Any, ...]:
    """train_transform for encoded samples ``(bytes tensor, *rest)``: attaches a drawn Crop, decodes nothing."""
    data, *rest = sample
    return (data, draw_crop(gen), *rest)


@dataclass
class EncodedBatch:
    """A micro-batch of undecoded images. Not a tuple, list or dict, so hpctrain's to_device leaves it on
    the host: nvJPEG reads its input from host memory."""

    data: list[torch.Tensor]
    """Encoded images, 1-D uint8 tensors."""
    crops: list[Crop]
    """Per image, the crop and flip to apply."""
    rest: list[Any]
    """The other fields, collated (e.g. labels)."""

    def pin_memory(self) -> "EncodedBatch":
        """Called by the DataLoader with pin_memory: the other fields (labels) are pinned, so their copy to the GPU
        is asynchronous; the encoded bytes stay as they are (nvJPEG reads them from the host)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        return EncodedBatch(self.data, self.crops, pin_memory(self.rest))

    def decode(self, device: torch.device, size: int) -> torch.Tensor:
        """N x 3 x size x size float in [0, 1] on ``device``."""
        return crop_resize_flip(decode_images(self.data, device), self.crops, size)


def collate_encoded(samples: Sequence[tuple[Any, ...]]) -> EncodedBatch:
    """collate_fn for samples ``(bytes, Crop, *rest)`` (or ``(bytes, *rest)`` without augmentation)."""
    from torch.utils.data import default_collate

    data = [s[0] for s in samples]
    has_crop = all(isinstance(s[1], Crop) for s in samples) if samples and len(samples[0]) > 1 else False
    crops = [s[1] for s in samples] if has_crop else [FULL] * len(samples)
    rest = [s[2:] if has_crop else s[1:] for s in samples]
    return EncodedBatch(data, crops, list(default_collate(rest)) if rest and rest[0] else [])


def decode_images(data: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Decode to 3 x H x W uint8 on ``device``: JPEGs in one batched call (nvJPEG on CUDA), others on the CPU
    (data/image_decode.py chooses TorchCodec or torchvision)."""
    out: list[torch.Tensor | None] = [None] * len(data)
    jpegs = [i for i, d in enumerate(data) if is_jpeg(d)]
    if jpegs:
        for i, image in zip(jpegs, decode_jpegs([data[i] for i in jpegs], device)):
            out[i] = image
    for i, d in enumerate(data):
        if out[i] is None:
            out[i] = decode_image(d, "RGB").to(device, non_blocking=True)
    return out  # type: ignore[return-value]


def crop_resize_flip(images: Sequence[torch.Tensor], crops: Sequence[Crop], size: int) -> torch.Tensor:
    """Crop each image (any size), resize to size x size (bilinear, antialiased), flip; stacked, in [0, 1]."""
    if len(images) != len(crops):
        raise ValueError(f"{len(images)} images but {len(crops)} crops")
    out = []
    for image, crop in zip(images, crops):
        top, left, h, w = crop.box(*image.shape[-2:])
        part = image[:, top : top + h, left : left + w].unsqueeze(0).float()
        part = F.interpolate(part, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        out.append(part.flip(-1) if crop.flip else part)
    return torch.cat(out).div_(255.0).clamp_(0.0, 1.0)
