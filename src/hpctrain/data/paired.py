"""Augmentation of an image and its label map together: one crop, one flip, for both.

A horizontal flip mirrors the face, so a left eye becomes a right eye: the label map's
left/right classes are swapped through ``flip_perm`` (for CelebAMask-HQ:
:func:`hpctrain.datasets.sources.celebamask.flip_permutation`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paired_crop_flip(
    image: torch.Tensor, labels: torch.Tensor, gen: torch.Generator, size: int,
    flip_perm: torch.Tensor | None = None, scale: tuple[float, float] = (0.75, 1.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """image CxHxW (any dtype), labels 1xHxW or HxW integer map -> both cropped to a random square of
    ``scale`` of the shorter side, resized to size x size (bilinear / nearest), and flipped with p=0.5."""
    h, w = image.shape[-2:]
    if labels.shape[-2:] != (h, w):
        raise ValueError(f"image {tuple(image.shape[-2:])} and label map {tuple(labels.shape[-2:])} differ in size")
    side = int(min(h, w) * (scale[0] + (scale[1] - scale[0]) * torch.rand((), generator=gen).item()))
    side = max(1, side)
    y0 = int(torch.randint(0, h - side + 1, (1,), generator=gen))
    x0 = int(torch.randint(0, w - side + 1, (1,), generator=gen))
    flip = bool(torch.rand((), generator=gen) < 0.5)
    img = image[..., y0 : y0 + side, x0 : x0 + side]
    lab = labels[..., y0 : y0 + side, x0 : x0 + side]
    img = resize_bilinear(img, size)
    squeeze = lab.dim() == 2
    lab3 = lab[None] if squeeze else lab
    lab = resize_nearest(lab3, size)
    lab = lab[0] if squeeze else lab
    if flip:
        img, lab = img.flip(-1), lab.flip(-1)
        if flip_perm is not None:
            lab = flip_perm.to(lab.device)[lab.long()].to(labels.dtype)
    return img, lab


def resize_bilinear(image: torch.Tensor, size: int) -> torch.Tensor:
    """C x H x W -> C x size x size, bilinear with antialiasing, in the image's dtype.

    A uint8 image on the CPU goes through torch's own uint8 kernel (vectorised, fixed point), not through float:
    a 220 px crop of a 3-channel face to 256 px takes 0.87 ms instead of 3.5 ms on one core, and the result is
    within one intensity level of the float path's (benchmarks/faceseg_decode.py: it was most of a face's loader
    cost). The fast kernel is torch's x86 (AVX2) one; other CPUs (aarch64) run a generic uint8 kernel: measure there."""
    if image.dtype == torch.uint8 and image.device.type == "cpu":
        return F.interpolate(image[None], size=(size, size), mode="bilinear", align_corners=False, antialias=True)[0]
    out = F.interpolate(image[None].float(), size=(size, size), mode="bilinear", align_corners=False, antialias=True)[0]
    return out.to(image.dtype) if image.dtype.is_floating_point else out.round().clamp(0, 255).to(image.dtype)


def resize_nearest(labels: torch.Tensor, size: int) -> torch.Tensor:
    """C x H x W label maps -> C x size x size by nearest neighbour (uint8 directly: no float copy; the same result)."""
    if labels.dtype == torch.uint8 or labels.dtype.is_floating_point:
        return F.interpolate(labels[None], size=(size, size), mode="nearest")[0]
    return F.interpolate(labels[None].float(), size=(size, size), mode="nearest")[0].to(labels.dtype)
