"""Everything hpctrain does differently by torch version, in one place.

Cluster users bring hpctrain to the torch their site ships (GPU images had 2.11 in 2026-11), so the supported
range is a floor (TORCH_FLOOR, stated in pyproject and the README and tested in CI) up to the pinned build of the
Makefile. Code elsewhere asks this module instead of testing versions or attributes itself, so the next torch that
moves an API changes one file; each entry says which versions differ and why.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import re
from typing import Any

from hpctrain.errors import UserError

TORCH_FLOOR = (2, 11)
"""The oldest torch hpctrain supports and tests (CI runs the unit tier and a multi-process smoke test on it)."""
UPGRADE = "pip install 'torch>=2.11' (with the matching torchvision), or use a site module/image that provides it"


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: '2.11.0+cu130' -> (2, 11); '2.14.0a0+git123' -> (2, 14)."""
    found = re.match(r"(\d+)\.(\d+)", text)
    if not found:
        raise ValueError(f"not a torch version: {text!r}")
    return int(found.group(1)), int(found.group(2))


def installed_torch() -> str:
    """torch's version without importing torch (seconds), so the CLI can check it before any command."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # torch on sys.path without its metadata (a bare copy)
        import torch

        return torch.__version__


def check_torch(version: str | None = None) -> None:
    """Refuse a torch below the floor at start-up, with what to upgrade, instead of an AttributeError mid-run."""
    version = version or installed_torch()
    if parse_version(version) < TORCH_FLOOR:
        raise UserError(f"hpctrain needs torch >= {TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}; this environment has torch "
                        f"{version}", hint=UPGRADE)


# ---- process groups ------------------------------------------------------------------------------------------

def gloo_group(connect_timeout_s: float, timeout_s: float) -> Any:
    """A new gloo group over all ranks whose collectives time out after timeout_s. Where torch can change a group's
    timeout after it is made (dist.set_timeout, torch >= 2.14), connecting gets the shorter connect_timeout_s: a node
    whose hostname resolves to an address the others cannot reach fails at start-up, not after timeout_s. Older
    torch connects under timeout_s."""
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=connect_timeout_s))
    dist.set_timeout(datetime.timedelta(seconds=timeout_s), group)
    return group


# ---- checkpoint staging --------------------------------------------------------------------------------------

# torch 2.11 and 2.12: DefaultStager._stage ends with self._state_dict_stager.close(), which clears the stager's
# deepcopy dispatch table (and its storage cache). The next stage() of the same DefaultStager then finds no copier
# for dict, falls back to __reduce_ex__, reaches the `dict` class itself and looks up `type` in the emptied table:
# KeyError: <class 'type'>. So every second asynchronous save failed there, on CPUs and GPUs alike (on the first
# GPU run: the digits demo's step-200 save, after the step-100 one). torch 2.13 dropped that close() from _stage.
def stager_single_use() -> bool:
    """From the torch this process imported (a PYTHONPATH or module setup can differ from the installed metadata)."""
    import torch

    return parse_version(torch.__version__) < (2, 13)


class CheckpointStager:
    """A CPU copy of a state dict of tensors (DTensor shards included) for every save of a run, on every supported
    torch, into buffers kept from one save to the next; pinned, with non-blocking copies and one synchronisation, on
    GPUs. torch >= 2.13: DCP's DefaultStager. torch 2.11 and 2.12: the StateDictStager that DefaultStager wraps,
    called as DefaultStager calls it but without the close() after each stage (a fresh DefaultStager per save would
    also work, but pins fresh memory every time: measured on an H100 with the DDPM state, 580 MB, the pause of an
    asynchronous save was 228-501 ms that way against ~60 ms with the buffers kept)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._stager: Any = None
        self._single_use = False

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        if self._stager is None:
            self._single_use = stager_single_use()
            self._stager = self._new()
        if not self._single_use:
            return self._stager.stage(state)
        import torch

        staged = self._stager.stage(state, non_blocking=self.cuda)
        if self.cuda:  # the non-blocking copies were queued on the current stream: complete before training goes on
            torch.cuda.synchronize()
        return staged

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _new(self) -> Any:
        if self._single_use:
            from torch.distributed.checkpoint._state_dict_stager import StateDictStager

            return StateDictStager(pin_memory=self.cuda, share_memory=False)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # pinned memory and non-blocking copies need CUDA (the stager refuses them without an accelerator)
        return DefaultStager(StagingOptions(use_pinned_memory=self.cuda, use_shared_memory=False,
                                            use_async_staging=False, use_non_blocking_copy=self.cuda))
