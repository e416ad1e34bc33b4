"""The one place that decodes images (data/image_decode.py): TorchCodec and torchvision give the same pixels on the
repo's fixtures (JPEG faces and PNG masks in CelebAMask-HQ's layout, JPEG ImageFolder images, RGB and grey PNGs),
both show an image as its EXIF orientation says, and no deprecation warning is left per call."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from hpctrain.data import image_decode
from hpctrain.data.image_decode import backend, decode_image, decode_jpegs
from hpctrain.datasets.fixtures import make_celebamask, make_imagefolder



def _torchcodec_loads() -> bool:
    try:
        import torchcodec.decoders  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # absent, or built for another torch
        return False
    return True


HAS_TORCHCODEC = _torchcodec_loads()
needs_torchcodec = pytest.mark.skipif(not HAS_TORCHCODEC, reason="torchcodec is not installed or does not load with "
                                      "this torch: the torchvision path alone is tested")
JPEG_TOLERANCE = 1
"""Grey levels two JPEG decoders may differ by (IDCT rounding of another libjpeg build); PNG must be exact."""


def _bytes(path: Path) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)


def _encoded(array: np.ndarray, fmt: str, **save) -> torch.Tensor:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt, **save)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> list[tuple[str, torch.Tensor]]:
    """(mode, bytes) of every fixture image the data tests use, and PNGs in RGB and 16-bit grey."""
    root = tmp_path_factory.mktemp("fixtures")
    celeba = make_celebamask(root / "celeba", count=6)
    folder = make_imagefolder(root / "folder", classes=2, per_class=3)
    items = [("RGB", _bytes(p)) for p in sorted(celeba.rglob("*.jpg")) + sorted(folder.rglob("*.jpg"))]
    items += [("GRAY", _bytes(p)) for p in sorted(celeba.rglob("*.png"))[:12]]
    rng = np.random.default_rng(0)
    items += [("RGB", _encoded(rng.integers(0, 256, (17, 23, 3), dtype=np.uint8), "PNG")),
              ("UNCHANGED", _encoded(rng.integers(0, 256, (9, 11), dtype=np.uint8), "PNG"))]
    return items


@needs_torchcodec
def test_both_decoders_give_the_same_pixels_on_the_fixtures(fixtures):
    worst = {"jpeg": 0, "png": 0}
    for mode, data in fixtures:
        codec = decode_image(data, mode, using="torchcodec")
        vision = decode_image(data, mode, using="torchvision")
        assert codec.shape == vision.shape and codec.dtype == vision.dtype, mode
        kind = "jpeg" if image_decode.is_jpeg(data) else "png"
        worst[kind] = max(worst[kind], int((codec.int() - vision.int()).abs().max()))
    assert worst["png"] == 0, worst
    assert worst["jpeg"] <= JPEG_TOLERANCE, worst


@needs_torchcodec
def test_the_batched_jpeg_path_agrees_too(fixtures):
    jpegs = [d for _, d in fixtures if image_decode.is_jpeg(d)]
    codec = decode_jpegs(jpegs, torch.device("cpu"), using="torchcodec")
    vision = decode_jpegs(jpegs, torch.device("cpu"), using="torchvision")
    assert all((a.int() - b.int()).abs().max() <= JPEG_TOLERANCE for a, b in zip(codec, vision))


def test_torchcodec_is_chosen_where_it_is_installed():
    assert backend() == ("torchcodec" if HAS_TORCHCODEC else "torchvision")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize("using", ["torchvision", pytest.param("torchcodec", marks=needs_torchcodec)])
@pytest.mark.parametrize("orientation", [1, 3, 6, 7])
def test_images_come_out_as_shown_with_their_exif_orientation(using: str, orientation: int, fmt: str):
    rng = np.random.default_rng(orientation)
    pixels = rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _encoded(pixels, fmt, exif=exif.tobytes(), **({"quality": 95} if fmt == "JPEG" else {}))
    shown = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data.numpy().tobytes()))).convert("RGB"))
    got = decode_image(data, "RGB", using=using)
    want = torch.from_numpy(shown.copy()).permute(2, 0, 1)
    assert got.shape == want.shape
    assert (got.int() - want.int()).abs().max() <= (0 if fmt == "PNG" else 2)  # Pillow's JPEG decode: its own IDCT


def test_no_deprecation_warning_per_call(fixtures):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, each time: what a per-call warning would do to the log
        for mode, data in fixtures[:4]:
            decode_image(data, mode, using="torchvision")
            decode_image(data, mode)
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)], [str(w.message) for w in caught]


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="choose from"):
        decode_image(torch.zeros(4, dtype=torch.uint8), "CMYK")
