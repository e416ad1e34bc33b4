"""Random-number streams: identical for model init on every rank, then one stream per rank.

Data order and augmentation do not use these (they are derived from seed, epoch
and index); these cover what the model does at random (dropout, noise in a
diffusion loss). Per-rank streams are saved in checkpoints and restored when
the world size is unchanged; on a different world size they are re-derived from
(seed, rank, step), so that part of a resumed run differs from an uninterrupted one.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from hpctrain.data.seeding import SALT_RANK, mix_seed


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def seed_rank_streams(seed: int, rank: int, step: int = 0) -> None:
    seed_everything(mix_seed(SALT_RANK, seed, rank, step))


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This process's random streams: Python's, NumPy's global one (np.random.*, which user code and libraries
    draw from), torch's CPU one and the device's. Plain values and tensors only, so it loads with weights_only."""
    return {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Set the streams capture_rng took. A checkpoint from before NumPy's stream was captured has no "numpy"
    entry: that stream is then left as it is (seeded by seed_everything)."""
    random.setstate(state["python"])
    if state.get("numpy") is not None:
        _set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def _numpy_state() -> dict[str, Any]:
    # The legacy tuple holds a uint32 ndarray, which weights_only=True refuses to unpickle: the key goes as an
    # int64 tensor (it holds values up to 2**32 - 1), the rest as plain numbers.
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {"bit_generator": str(name), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}


def _set_numpy_state(state: dict[str, Any]) -> None:
    key = state["key"].numpy().astype(np.uint32)
    np.random.set_state((state["bit_generator"], key, state["pos"], state["has_gauss"], state["cached_gaussian"]))
