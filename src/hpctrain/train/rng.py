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
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
