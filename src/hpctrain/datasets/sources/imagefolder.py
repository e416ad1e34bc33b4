"""ImageFolder layout: ``SOURCE/<class>/<image>`` or ``SOURCE/<split>/<class>/<image>`` (split: train, val, test)."""

from __future__ import annotations

from pathlib import Path

from hpctrain.errors import UserError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".ppm", ".pgm"}
SPLIT_NAMES = ("train", "val", "test")


def split_dirs(source: Path) -> dict[str, Path]:
    """{split: directory of class folders}. Without split folders the whole source is 'train'."""
    if not source.is_dir():
        raise UserError(f"{source} is not a directory", "pass the folder that holds one sub-folder per class.")
    found = {s: source / s for s in SPLIT_NAMES if (source / s).is_dir()}
    return found or {"train": source}


def classes(split_dir: Path) -> list[str]:
    names = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not names:
        raise UserError(f"no class folders in {split_dir}", "ImageFolder layout: one sub-folder of images per class.")
    return names


def files(split_dir: Path, class_names: list[str]) -> list[tuple[Path, int]]:
    """(path, class index), sorted by class then path: the same order on every machine."""
    out = []
    for c, name in enumerate(class_names):
        for path in sorted((split_dir / name).rglob("*")):
            if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file():
                out.append((path, c))
    if not out:
        raise UserError(f"no images in the class folders of {split_dir}", f"supported: {sorted(IMAGE_SUFFIXES)}.")
    return out
