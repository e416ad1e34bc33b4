"""Face-parsing samples: an image and its 19-class label map, both size x size.

Two sources. ``celebamask``: the release layout (CelebA-HQ-img + CelebAMask-HQ-mask-anno), read per sample
(a 1024x1024 JPEG and up to 18 part masks; fine for a test, slow for training: shard it). ``shards``: made by
``hpctrain shard SRC OUT --format celebamask --resize 256`` (JPEG image + PNG label map per sample), read
in large blocks in the shard path's order. Generated faces (``hpctrain synth faces``) are in the release layout
and read through either.

Training augmentation: one random crop (model.crop_scale of the side) and flip for image and labels together,
with the left/right classes swapped on a flip. With model.gpu_decode the loader only reads bytes and decodes the
(small) label PNG; the JPEG is decoded, cropped and resized on the GPU (nvJPEG), the same crop applied to the
labels in the loader.
"""

from __future__ import annotations

import functools
import shlex
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from hpctrain.data.gpu_decode import Crop, draw_crop
from hpctrain.data.paired import paired_crop_flip, resize_bilinear, resize_nearest
from hpctrain.datasets.sources import celebamask
from hpctrain.errors import UserError
from hpctrain.experiments.base import Datasets

FLIP = celebamask.flip_permutation()


class ReleaseLayout(Dataset):
    """CelebAMask-HQ as released: (3 x S x S uint8 image, S x S uint8 labels) per id, resized to S on read."""

    def __init__(self, root: Path, ids: list[int], size: int) -> None:
        self.root, self.ids, self.size = root, ids, size

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from hpctrain.data.image_decode import decode_image

        data = celebamask.read_image(self.root, self.ids[i])
        image = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), "RGB")
        labels = torch.from_numpy(celebamask.label_map(self.root, self.ids[i], (self.size, self.size)).copy())
        return resize_image(image, self.size), labels


class Resized(Dataset):
    """Shard samples (image, 1 x H x W label PNG) as (3 x S x S, S x S), resized when the shards are not S."""

    def __init__(self, shards: Dataset, size: int) -> None:
        self.shards, self.size = shards, size
        self.epoch_order = getattr(shards, "epoch_order", None)

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, labels = self.shards[i]
        return resize_image(_rgb(image), self.size), resize_labels(labels.reshape(labels.shape[-2:]), self.size)


class Encoded(Resized):
    """gpu_decode: (JPEG bytes, labels); the image is decoded and resized on the device. Labels at the shards' size
    (size 0: the training crop resizes them) or resized to size x size."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        data, label_png = self.shards[i]
        labels = _decode_labels(label_png)
        return data, resize_labels(labels, self.size) if self.size else labels


def resize_image(image: torch.Tensor, size: int) -> torch.Tensor:
    if tuple(image.shape[-2:]) == (size, size):
        return image
    return resize_bilinear(image, size)


def resize_labels(labels: torch.Tensor, size: int) -> torch.Tensor:
    if tuple(labels.shape[-2:]) == (size, size):
        return labels
    return resize_nearest(labels[None], size)[0]


def _rgb(image: torch.Tensor) -> torch.Tensor:
    return image.expand(3, -1, -1) if image.shape[0] == 1 else image[:3]


def _decode_labels(data: torch.Tensor) -> torch.Tensor:
    from hpctrain.data.image_decode import decode_image

    return decode_image(data, "GRAY")[0]


def crop_flip(sample: tuple[torch.Tensor, torch.Tensor], gen: torch.Generator, size: int,
              scale: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    image, labels = sample
    return paired_crop_flip(image, labels, gen, size, FLIP, scale)


def encoded_crop_flip(sample: tuple[torch.Tensor, torch.Tensor], gen: torch.Generator, size: int,
                      scale: tuple[float, float]) -> tuple[torch.Tensor, Crop, torch.Tensor]:
    """gpu_decode training: draw the crop, apply it to the labels here, leave the JPEG for the device."""
    data, labels = sample
    crop = draw_crop(gen, scale)
    top, left, h, w = crop.box(*labels.shape[-2:])
    labels = resize_labels(labels[top : top + h, left : left + w], size)
    if crop.flip:
        labels = FLIP[labels.long()].to(labels.dtype).flip(-1)
    return data, crop, labels


def build(o: Any, data_cfg: Any) -> Datasets:
    """Datasets for FaceSegOptions ``o``."""
    root = Path(o.data_root)
    if o.source == "celebamask":
        if o.gpu_decode:
            raise UserError("model.gpu_decode=true reads shards", "shard the set first (hpctrain shard ... --format "
                            "celebamask) and set model.source=shards, or set model.gpu_decode=false.")
        ids = celebamask.image_ids(root)
        split = celebamask.splits(root, ids)
        train, val = ReleaseLayout(root, split["train"], o.image_size), ReleaseLayout(root, split["val"], o.image_size)
        return Datasets(train=train, val=val or None,
                        train_transform=functools.partial(crop_flip, size=o.image_size, scale=o.crop_scale))
    return _shards(root, o, data_cfg)


def _shards(root: Path, o: Any, data_cfg: Any) -> Datasets:
    from hpctrain.data.gpu_decode import collate_encoded
    from hpctrain.data.shardset import ShardDataset, shard_dataset

    def split(name: str) -> ShardDataset:
        if not (root / name).is_dir():
            raise UserError(f"no {name} shards at {root / name}",
                            "write them with: hpctrain shard CELEBAMASK_DIR "
                            f"{shlex.quote(str(root))} --format celebamask --resize "
                            f"{o.image_size} (or set model.data_root).")
        return shard_dataset(root / name, ["jpg", "png"], data_cfg, decode=not o.gpu_decode)

    train, val = split("train"), split("val")
    if o.gpu_decode:
        # Augmented training labels stay at the shards' size until the crop: cropped once, resized once.
        train_set = Encoded(train, 0 if data_cfg.augment else o.image_size)
        return Datasets(train=train_set, val=Encoded(val, o.image_size), collate_fn=collate_encoded,
                        train_transform=functools.partial(encoded_crop_flip, size=o.image_size, scale=o.crop_scale))
    return Datasets(train=Resized(train, o.image_size), val=Resized(val, o.image_size),
                    train_transform=functools.partial(crop_flip, size=o.image_size, scale=o.crop_scale))
