"""Seeds derived from (seed, epoch, index, ...) alone, never from the rank.

A sample's augmentation then is the same whichever rank or worker loads it, so
results do not depend on the number of processes. splitmix64 is the mixing
function of Java's SplittableRandom and numpy's SeedSequence family: cheap,
well-distributed, and stable across platforms and versions (unlike hash()).
"""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """One 63-bit seed from several integers; order matters."""
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (p & _MASK))
    return h & ((1 << 63) - 1)


# Salts keep the streams for different purposes apart even for equal (seed, epoch).
SALT_ORDER = 1
SALT_SAMPLE = 2
SALT_RANK = 3
SALT_WORKER = 4
# 5: SALT_POSITION (data/positional.py)
SALT_SHARD_LOCAL = 6


def generator(*parts: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(mix_seed(*parts))
    return g


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The augmentation stream of one sample in one epoch."""
    return generator(SALT_SAMPLE, seed, epoch, index)
