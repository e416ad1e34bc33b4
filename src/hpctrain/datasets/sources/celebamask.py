"""CelebAMask-HQ in the layout of its release.

    CelebA-HQ-img/<id>.jpg                                  30,000 images, 1024x1024
    CelebAMask-HQ-mask-anno/<id // 2000>/<id:05d>_<part>.png  one binary 512x512 mask per present part
    CelebA-HQ-to-CelebA-mapping.txt, list_eval_partition.txt  (optional) the standard split

The part masks become one label map of 19 classes (0 = background). Parts are painted in
CLASSES order and a later part overwrites an earlier one where they overlap, as the
release's own ``g_mask.py`` does (so hair covers skin, and cloth is painted last).
A part file is absent when the face has no such part (no hat, no glasses): that is
normal; an image with no part file at all is an error.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from PIL import Image

from hpctrain.errors import UserError

CLASSES = ("background", "skin", "nose", "eye_g", "l_eye", "r_eye", "l_brow", "r_brow", "l_ear", "r_ear",
           "mouth", "u_lip", "l_lip", "hair", "hat", "ear_r", "neck_l", "neck", "cloth")
PARTS = CLASSES[1:]
IMAGES = "CelebA-HQ-img"
MASKS = "CelebAMask-HQ-mask-anno"
MAPPING = "CelebA-HQ-to-CelebA-mapping.txt"
PARTITION = "list_eval_partition.txt"
SPLIT_SEED = 20_240_527  # the fallback split is part of the data set's definition, not of a run
VAL_FRACTION = 0.1  # 27k/3k, as in the source blog
# A horizontal flip turns a left part into a right one. ("ear_r" is the earring, not the right ear.)
FLIP_PAIRS = (("l_eye", "r_eye"), ("l_brow", "r_brow"), ("l_ear", "r_ear"))


def flip_permutation() -> torch.Tensor:
    """Class c of a flipped label map is class perm[c]."""
    perm = torch.arange(len(CLASSES))
    for a, b in FLIP_PAIRS:
        i, j = CLASSES.index(a), CLASSES.index(b)
        perm[i], perm[j] = j, i
    return perm


def image_ids(root: Path) -> list[int]:
    folder = root / IMAGES
    if not folder.is_dir():
        raise UserError(f"CelebAMask-HQ not found: {folder} is missing",
                        "download CelebAMask-HQ (https://github.com/switchablenorms/CelebAMask-HQ, Google Drive; "
                        "it cannot be fetched by script) and unzip it; pass the folder that holds CelebA-HQ-img.")
    if not (root / MASKS).is_dir():
        raise UserError(f"CelebAMask-HQ masks not found: {root / MASKS} is missing", "unzip the full CelebAMask-HQ archive.")
    ids = sorted(int(p.stem) for p in folder.glob("*.jpg") if p.stem.isdigit())
    if not ids:
        raise UserError(f"no <id>.jpg images in {folder}", "check the download.")
    return ids


def splits(root: Path, ids: list[int]) -> dict[str, list[int]]:
    """The standard train/val/test split through CelebA's partition when its files are present,
    else a seeded 90/10 train/val split (27k/3k of 30k)."""
    mapping, partition = root / MAPPING, root / PARTITION
    if mapping.exists() and partition.exists():
        part_of = {}
        for line in partition.read_text().split("\n"):
            fields = line.split()
            if len(fields) == 2:
                part_of[fields[0]] = int(fields[1])
        out: dict[str, list[int]] = {"train": [], "val": [], "test": []}
        names = ("train", "val", "test")
        present = set(ids)  # once: a set per line made this quadratic (30,000 ids)
        for line in mapping.read_text().split("\n")[1:]:
            fields = line.split()
            if len(fields) == 3 and int(fields[0]) in present:
                if fields[2] not in part_of:
                    raise UserError(f"{mapping}: {fields[2]} is not in {partition}", "use the files of the same release.")
                out[names[part_of[fields[2]]]].append(int(fields[0]))
        return out
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    n_val = round(len(ids) * VAL_FRACTION)
    return {"train": sorted(ids[i] for i in order[n_val:]), "val": sorted(ids[i] for i in order[:n_val])}


def label_map(root: Path, image_id: int, size: tuple[int, int] | None = None) -> np.ndarray:
    """HxW uint8 class indices from the part masks of one image (nearest-neighbour resized to ``size``)."""
    folder = root / MASKS / str(image_id // 2000)
    labels: np.ndarray | None = None
    found = 0
    for c, part in enumerate(PARTS, start=1):
        path = folder / f"{image_id:05d}_{part}.png"
        if not path.exists():
            continue
        try:
            with Image.open(path) as img:
                mask = np.asarray(img.convert("L")) > 127
        except Exception as err:
            raise UserError(f"cannot read mask {path} ({type(err).__name__}: {err})",
                            "the file is corrupt: unzip the archive again.") from None
        if labels is None:
            labels = np.zeros(mask.shape, dtype=np.uint8)
        elif mask.shape != labels.shape:
            raise UserError(f"mask {path} is {mask.shape[::-1]}, the other parts of image {image_id} {labels.shape[::-1]}",
                            "the annotation files are mixed up: unzip the archive again.")
        labels[mask] = c
        found += 1
    if labels is None:
        raise UserError(f"image {image_id} has no mask parts in {folder} (expected {image_id:05d}_skin.png, ...)",
                        "the annotation archive is incomplete, or pass --on-error skip to leave such images out.")
    if size is not None and labels.shape[::-1] != size:
        labels = np.asarray(Image.fromarray(labels).resize(size, Image.NEAREST))
    return labels


def read_image(root: Path, image_id: int) -> bytes:
    return (root / IMAGES / f"{image_id}.jpg").read_bytes()


def image_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as img:
        return img.size


def samples(root: Path, ids: list[int], resize: int) -> Iterator[tuple[int, bytes, np.ndarray]]:
    """(id, JPEG bytes, label map of the same size) per image; the image is pre-resized when ``resize``."""
    from hpctrain.datasets.sources.images import resize_shorter

    for image_id in ids:
        data = read_image(root, image_id)
        if resize:
            data, _ = resize_shorter(data, resize, "jpg", square=True)
        try:
            size = image_size(data)
        except Exception as err:
            raise UserError(f"cannot read image {root / IMAGES}/{image_id}.jpg ({err})", "the file is corrupt: unzip again.") from None
        yield image_id, data, label_map(root, image_id, size)
