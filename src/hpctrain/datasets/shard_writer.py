"""Pack a data set into shards (`hpctrain shard SOURCE OUT --format cifar10|celebamask|imagefolder`, whose
arguments are in commands/shard.py).

OUT gets one directory per split (``train/``, ``val/`` or ``test/``) holding the tars,
``index.json`` and ``manifest.json``. Each split is written into a temporary directory
beside it and renamed into place when complete, so an interrupted run never leaves a
half-written split where a good one was.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from tqdm import tqdm

from hpctrain.data.shards import MANIFEST, write_split
from hpctrain.errors import UserError

log = logging.getLogger("hpctrain")

FORMATS = ("cifar10", "celebamask", "imagefolder")


@dataclass(frozen=True)
class ShardRequest:
    source: Path
    """The data set as published (see the --format choices)."""
    out: Path
    """Output directory; one sub-directory per split."""
    format: str
    """cifar10, celebamask or imagefolder."""
    shard_size: int
    """Maximum bytes per tar."""
    resize: int = 0
    """Pre-resize images so the shorter side is this many pixels (0: keep)."""
    download: bool = False
    """Download the source when missing (CIFAR-10 only; needs internet)."""
    on_error: str = "raise"
    """raise: stop at an unreadable source file; skip: leave it out, count it in the manifest."""
    force: bool = False
    """Replace existing complete splits."""


class Skips:
    """Unreadable source files left out under --on-error skip."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.items: list[str] = []

    def guard(self, what: str, make: Callable[[], Any]) -> Any | None:
        try:
            return make()
        except UserError as err:
            if self.policy != "skip":
                raise
            self.items.append(f"{what}: {str(err).splitlines()[0]}")
            return None


def write_shards(req: ShardRequest) -> int:
    if req.format not in FORMATS:
        raise UserError(f"unknown format '{req.format}'", f"choose one of {', '.join(FORMATS)}.")
    builders = {"cifar10": _cifar10, "celebamask": _celebamask, "imagefolder": _imagefolder}
    source, out = req.source.resolve(), req.out.resolve()
    if req.format == "imagefolder" and (out == source or source in out.parents):  # the others read named files only
        raise UserError(f"the output {req.out} lies inside the source {req.source}",
                        "ImageFolder reads every sub-folder, so the shards would become a class: choose an OUT outside SOURCE.")
    req.out.mkdir(parents=True, exist_ok=True)
    for split, samples, extra in builders[req.format](req):
        _write_one_split(req, split, samples, extra)
    return 0


def _write_one_split(req: ShardRequest, split: str, samples: Iterator[dict[str, Any]], extra: dict[str, Any]) -> None:
    final = req.out / split
    if (final / MANIFEST).exists() and not req.force:
        raise UserError(f"{final} already holds a complete shard set", "pass --force to replace it, or choose another OUT.")
    tmp = req.out / f".{split}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    skips: Skips = extra.pop("_skips")
    # A bar on a terminal only (tqdm's disable=None): a batch job's log gets the summary line below.
    samples = tqdm(samples, total=extra.pop("_count", None), desc=f"shard {split}", unit=" samples", disable=None)
    started = time.perf_counter()
    meta = {"dataset": req.format, "split": split, "source": str(req.source), "resize": req.resize, **extra}
    try:
        count = write_split(tmp, split, samples, req.shard_size, {**meta, "skipped": skips.items})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if count == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"no samples for split '{split}' in {req.source}", "check the source directory.")
    if final.exists():
        old = req.out / f".{split}.old"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    size = sum(p.stat().st_size for p in final.glob("*.tar"))
    log.info("%s: %d samples in %d shard(s), %.1f MB, %.1f s -> %s", split, count, len(list(final.glob("*.tar"))),
             size / 1e6, time.perf_counter() - started, final)
    for item in skips.items:
        log.warning("skipped %s", item)
    if skips.items:
        log.warning("%s: %d source file(s) skipped (listed in %s)", split, len(skips.items), final / MANIFEST)


def _cifar10(req: ShardRequest):
    from hpctrain.datasets.sources import cifar10
    from hpctrain.datasets.sources.images import encode_png

    cifar10.check_present(req.source, req.download)
    for split in ("train", "test"):
        skips = Skips(req.on_error)

        def gen(split: str = split) -> Iterator[dict[str, Any]]:
            for i, (image, label, meta) in enumerate(cifar10.samples(req.source, split)):
                # PNG: lossless, so the shards hold CIFAR's exact pixels (a generative model learns JPEG artefacts).
                yield {"__key__": f"{i:06d}", "png": encode_png(image), "cls": label, "json": meta}

        yield split, gen(), {"classes": list(cifar10.CLASSES), "_skips": skips}


def _celebamask(req: ShardRequest):
    from hpctrain.datasets.sources import celebamask
    from hpctrain.datasets.sources.images import encode_png

    ids = celebamask.image_ids(req.source)
    for split, members in celebamask.splits(req.source, ids).items():
        skips = Skips(req.on_error)

        def gen(members: list[int] = members, skips: Skips = skips, split: str = split) -> Iterator[dict[str, Any]]:
            for image_id in members:
                item = skips.guard(f"image {image_id}", lambda i=image_id: next(celebamask.samples(req.source, [i], req.resize)))
                if item is not None:
                    _, jpg, labels = item
                    yield {"__key__": f"{image_id:05d}", "jpg": jpg, "png": encode_png(labels),
                           "json": {"id": image_id, "split": split}}

        if members:
            yield split, gen(), {"classes": list(celebamask.CLASSES), "_skips": skips, "_count": len(members)}


def _imagefolder(req: ShardRequest):
    from hpctrain.datasets.sources import imagefolder

    for split, directory in imagefolder.split_dirs(req.source).items():
        names = imagefolder.classes(directory)
        items = imagefolder.files(directory, names)
        skips = Skips(req.on_error)

        def gen(items=items, directory: Path = directory, skips: Skips = skips) -> Iterator[dict[str, Any]]:
            for i, (path, label) in enumerate(items):
                payload = skips.guard(str(path), lambda p=path: _image_payload(p, req.resize))
                if payload is not None:
                    data, ext = payload
                    yield {"__key__": f"{i:07d}", ext: data, "cls": label,
                           "json": {"path": str(path.relative_to(directory)), "class": names[label]}}

        yield split, gen(), {"classes": names, "_skips": skips, "_count": len(items)}


def _image_payload(path: Path, resize: int) -> tuple[bytes, str]:
    """The file's bytes unchanged (no re-compression) unless resizing; verified either way."""
    import io

    from PIL import Image

    from hpctrain.datasets.sources.images import resize_shorter

    data = path.read_bytes()
    ext = path.suffix.lower().lstrip(".")
    ext = "jpg" if ext == "jpeg" else ext
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()
        if resize:
            data, ext = resize_shorter(data, resize, ext)
    except Exception as err:
        raise UserError(f"cannot read image {path} ({type(err).__name__}: {err})",
                        "remove or replace the file, or pass --on-error skip.") from None
    return data, ext
