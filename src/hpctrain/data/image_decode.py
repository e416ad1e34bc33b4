"""Image decoding, chosen in this one place: TorchCodec (>= 0.16) where it is installed, torchvision's decoders
otherwise. torchvision 0.29 deprecated its decoders in favour of TorchCodec's and will remove them; the GPU images
of 2026-11 ship no TorchCodec, so both paths stay. Every caller in hpctrain decodes through here.

Both take the same bytes to the same pixels: PNG exactly, JPEG exactly here (both are libjpeg-turbo builds;
tests/unit/test_image_decode.py checks it on the repo's fixtures, with a tolerance of 1 grey level should a
build differ). torchvision's deprecation warning is silenced, for its message alone, by one filter when its
path is taken: a warning per decoded image would bury the log, and the choice is made here. Images come out as
they are shown: TorchCodec always applies the EXIF orientation, and torchvision is asked to (apply_exif_orientation;
before the switch only hpctrain predict asked, so a training image with an orientation tag other than 1 now trains
upright, on either path).
"""

from __future__ import annotations

import functools
import warnings
from typing import Sequence

import torch

MODES = ("UNCHANGED", "GRAY", "RGB")
TORCHCODEC_FLOOR = (0, 16)
"""The first TorchCodec with the decoders that replace torchvision's (what torchvision's warning names)."""
JPEG_MAGIC = b"\xff\xd8"
_TORCHVISION_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"


@functools.cache
def backend() -> str:
    """'torchcodec' or 'torchvision': which decoders this process uses (decided once)."""
    try:
        import torchcodec
        from torchcodec.decoders import decode_image  # noqa: F401 - the part hpctrain uses must import

        version = tuple(int(p) for p in torchcodec.__version__.split("+")[0].split(".")[:2])
        if version >= TORCHCODEC_FLOOR:
            return "torchcodec"
    except (ImportError, OSError, RuntimeError, ValueError):  # absent, or its native libraries do not load
        pass
    return "torchvision"


def _quiet_torchvision() -> None:
    """Ignore torchvision's deprecation of its decoders (its message alone), unless already ignored: one filter,
    not one warning per image."""
    for action, message, *_ in warnings.filters:
        if action == "ignore" and message is not None and message.pattern == _TORCHVISION_DEPRECATION:
            return
    warnings.filterwarnings("ignore", message=_TORCHVISION_DEPRECATION, category=DeprecationWarning)


def decode_image(data: torch.Tensor, mode: str = "RGB", using: str = "") -> torch.Tensor:
    """Encoded bytes (1-D uint8, on the CPU) -> C x H x W on the CPU, as shown: EXIF orientation applied (uint8; a
    16-bit PNG in UNCHANGED mode keeps 16 bits). ``using``: a backend by name (the tests compare both); '' the
    chosen one."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose from {MODES}")
    if (using or backend()) == "torchcodec":
        from torchcodec.decoders import decode_image as codec_decode

        return codec_decode(data, mode=mode, output_dtype="auto" if mode == "UNCHANGED" else torch.uint8)
    from torchvision.io import ImageReadMode, decode_image as vision_decode

    _quiet_torchvision()
    return vision_decode(data, mode=getattr(ImageReadMode, mode), apply_exif_orientation=True)


def decode_jpegs(data: Sequence[torch.Tensor], device: torch.device, using: str = "") -> list[torch.Tensor]:
    """JPEGs -> 3 x H x W uint8 on ``device``, in one batched call (nvJPEG on CUDA; both backends have it). On the
    CPU as shown (EXIF applied); torchvision's nvJPEG path applies no EXIF orientation."""
    if (using or backend()) == "torchcodec":
        from torchcodec.decoders import decode_jpeg

        return list(decode_jpeg(list(data), mode="RGB", device=device))
    from torchvision.io import ImageReadMode, decode_jpeg

    _quiet_torchvision()
    return list(decode_jpeg(list(data), mode=ImageReadMode.RGB, device=device,
                            apply_exif_orientation=device.type == "cpu"))


def is_jpeg(data: torch.Tensor) -> bool:
    return bytes(data[:2].tolist()) == JPEG_MAGIC
