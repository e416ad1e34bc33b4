"""Mixed precision: autocast dtype and, for fp16 only, a gradient scaler."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch

from hpctrain.errors import UserError


@dataclass(frozen=True)
class Precision:
    name: str
    """fp32, bf16 or fp16."""
    dtype: torch.dtype | None
    """Autocast dtype, or None for plain fp32."""
    device_type: str

    def autocast(self, cache: bool = True) -> ContextManager:
        """cache=False inside a captured CUDA graph: autocast's cache of weight casts would hold tensors made
        during capture and be reused by later eager code (torch.cuda.make_graphed_callables' rule)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=cache)

    def build_scaler(self) -> torch.amp.GradScaler:
        # bf16 has fp32's exponent range and needs no loss scaling; fp16 does.
        return torch.amp.GradScaler(self.device_type, enabled=self.name == "fp16")


def resolve_precision(requested: str, device: torch.device) -> Precision:
    cuda = device.type == "cuda"
    if requested == "auto":
        requested = auto_precision(device)
    if requested == "fp16" and not cuda:
        raise UserError(
            "train.precision='fp16' needs a GPU (fp16 autocast on CPU is slow and unscaled)",
            "use train.precision=auto, fp32 or bf16.",
        )
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[requested]
    return Precision(requested, dtype, device.type)


def auto_precision(device: torch.device) -> str:
    """bf16 where the GPU computes it natively (Ampere and later), fp16 with loss scaling elsewhere (V100, T4):
    emulated bf16 runs slower than fp32. fp32 on the CPU."""
    if device.type != "cuda":
        return "fp32"
    with torch.cuda.device(device):
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
