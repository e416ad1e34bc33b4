"""Image bytes in and out: pre-resizing for shards, and PNG encoding of arrays."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def encode_png(array: np.ndarray) -> bytes:
    """HxW (grey or label map) or HxWx3 uint8 -> PNG bytes (lossless)."""
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def resize_shorter(data: bytes, size: int, ext: str, square: bool = False) -> tuple[bytes, str]:
    """Re-encode an image with its shorter side at ``size`` (or as size x size), only when that shrinks it.

    Pre-resizing is the cheapest speed-up there is for full-size photos: at GPU speed, decoding
    a 1024x1024 JPEG costs more than the step's share of compute. Returns (bytes, extension)."""
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        w, h = img.size
        if min(w, h) <= size and not (square and w != h):
            return data, ext
        target = (size, size) if square else ((size, round(h * size / w)) if w <= h else (round(w * size / h), size))
        out = img.convert("RGB").resize(target, Image.BICUBIC)
    buf = io.BytesIO()
    if ext in ("jpg", "jpeg"):
        out.save(buf, format="JPEG", quality=95)
        return buf.getvalue(), "jpg"
    out.save(buf, format="PNG")
    return buf.getvalue(), "png"
