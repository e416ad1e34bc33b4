"""Miniature data sets in the exact on-disk formats of the real ones, for tests, the demo of
`hpctrain shard`, and the benchmark (the real data sets cannot be downloaded everywhere).

The pixels are simple class-dependent patterns plus noise, so a small model can learn them."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from hpctrain.datasets.sources import celebamask, cifar10


def pattern_image(rng: np.random.Generator, label: int, size: int) -> np.ndarray:
    """An image whose mean colour and stripe direction depend on the label."""
    base = np.array([(label * 37) % 256, (label * 91) % 256, (label * 151) % 256], dtype=np.float32)
    yy, xx = np.mgrid[0:size, 0:size]
    stripes = ((yy if label % 2 else xx) // max(1, size // 8)) % 2 * 60.0
    image = base[None, None, :] * 0.7 + stripes[..., None] + rng.normal(0, 12, (size, size, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def make_cifar10(root: Path, per_batch: int = 20, test: int = 20, seed: int = 0) -> Path:
    """root/cifar-10-batches-py with data_batch_1..5, test_batch and batches.meta, pickled like the originals."""
    folder = root / cifar10.FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = [*cifar10.TRAIN_BATCHES, *cifar10.TEST_BATCHES]
    for b, name in enumerate(names):
        n = test if name == "test_batch" else per_batch
        labels = [int(x) for x in rng.integers(0, 10, n)]
        images = np.stack([pattern_image(rng, y, 32) for y in labels]) if n else np.zeros((0, 32, 32, 3), np.uint8)
        batch = {
            b"batch_label": f"batch {b + 1} of 6".encode(),
            b"labels": labels,
            b"data": images.transpose(0, 3, 1, 2).reshape(n, 3072),  # R plane, G plane, B plane
            b"filenames": [f"fixture_{b}_{i}.png".encode() for i in range(n)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [c.encode() for c in cifar10.CLASSES], b"num_vis": 3072}, f, protocol=2)
    return folder


def make_celebamask(root: Path, count: int = 30, size: int = 64, mask_size: int = 32, seed: int = 0,
                    standard_split: bool = False) -> Path:
    """CelebA-HQ-img/<id>.jpg and CelebAMask-HQ-mask-anno/<id//2000>/<id:05d>_<part>.png; some images
    have a hat or glasses and most not, as in the real set. Optionally the CelebA split files."""
    rng = np.random.default_rng(seed)
    (root / celebamask.IMAGES).mkdir(parents=True, exist_ok=True)
    for image_id in range(count):
        face = Image.fromarray(pattern_image(rng, image_id % 7, size))
        buf = io.BytesIO()
        face.save(buf, format="JPEG", quality=90)
        (root / celebamask.IMAGES / f"{image_id}.jpg").write_bytes(buf.getvalue())
        folder = root / celebamask.MASKS / str(image_id // 2000)
        folder.mkdir(parents=True, exist_ok=True)
        m = mask_size
        shapes = {  # part -> ellipse box as fractions of the mask; later parts cover earlier ones
            "skin": (0.2, 0.15, 0.8, 0.85), "nose": (0.45, 0.45, 0.55, 0.6), "l_eye": (0.3, 0.35, 0.42, 0.42),
            "r_eye": (0.58, 0.35, 0.7, 0.42), "l_brow": (0.28, 0.28, 0.42, 0.32), "r_brow": (0.58, 0.28, 0.72, 0.32),
            "l_ear": (0.1, 0.4, 0.2, 0.6), "r_ear": (0.8, 0.4, 0.9, 0.6), "u_lip": (0.4, 0.68, 0.6, 0.72),
            "l_lip": (0.4, 0.72, 0.6, 0.77), "hair": (0.15, 0.0, 0.85, 0.25), "neck": (0.38, 0.85, 0.62, 1.0),
        }
        if image_id % 5 == 0:
            shapes["hat"] = (0.1, 0.0, 0.9, 0.12)
        if image_id % 4 == 1:
            shapes["eye_g"] = (0.25, 0.33, 0.75, 0.44)
        for part, (x0, y0, x1, y1) in shapes.items():
            mask = Image.new("L", (m, m), 0)
            ImageDraw.Draw(mask).ellipse((x0 * m, y0 * m, x1 * m, y1 * m), fill=255)
            mask.save(folder / f"{image_id:05d}_{part}.png")
    if standard_split:
        lines = ["idx orig_idx orig_file"]
        part = []
        for image_id in range(count):
            name = f"{100000 + image_id:06d}.jpg"
            lines.append(f"{image_id} {100000 + image_id} {name}")
            part.append(f"{name} {0 if image_id % 10 < 8 else (1 if image_id % 10 == 8 else 2)}")
        (root / celebamask.MAPPING).write_text("\n".join(lines) + "\n")
        (root / celebamask.PARTITION).write_text("\n".join(part) + "\n")
    return root


def make_imagefolder(root: Path, classes: int = 3, per_class: int = 10, size: int = 24, seed: int = 0,
                     splits: tuple[str, ...] = ()) -> Path:
    """root/[split/]class_k/img_NNNNN.jpg."""
    rng = np.random.default_rng(seed)
    for split in splits or ("",):
        for c in range(classes):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                Image.fromarray(pattern_image(rng, c, size)).save(folder / f"img_{i:05d}.jpg", quality=90)
    return root
