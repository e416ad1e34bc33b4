"""Random numbers that belong to a sample's position, not to the process that draws them.

A diffusion loss draws a timestep and a noise image per training sample. Drawn from each rank's own stream,
they change with the number of processes (rank 1 of 2 draws what rank 0 of 1 drew for another sample), so
the same run on 1 x 4 and 4 x 1 processes x accumulation would train differently. Per-sample CPU generators
would fix that and cost a generator per sample per step in the hot path.

Here the numbers of a *block* of consecutive positions come from one generator seeded by (parts..., block
number), on the device, and a rank slices its positions out of the blocks that cover them. With blocks of 64
(hpctrain's BatchInfo) and micro-batches of 64 that is one generator and one kernel per draw, whatever the
global batch (a block the size of the global batch would cost every rank the whole global batch's noise, 400 MB
per micro-step at 32,768 images of 3 x 32 x 32). The numbers depend on the device type (CUDA's Philox and the
CPU's Mersenne Twister differ) and, for draws over about a million elements, on the GPU model (torch's random
kernels size their grid by the number of multiprocessors); not on the number of devices.
"""

from __future__ import annotations

from typing import Callable

import torch

from hpctrain.data.seeding import mix_seed

SALT_POSITION = 5


def _blocks(
    draw: Callable[[torch.Generator, int], torch.Tensor], start: int, count: int, block: int, parts: tuple[int, ...],
    device: torch.device,
) -> torch.Tensor:
    if count < 0 or start < 0 or block < 1:
        raise ValueError(f"positions [{start}, {start + count}) in blocks of {block}: need start, count >= 0, block >= 1")
    first, last = start // block, (start + max(count, 1) - 1) // block
    drawn = []
    for b in range(first, last + 1):
        g = torch.Generator(device=device)
        g.manual_seed(mix_seed(SALT_POSITION, *parts, b))
        drawn.append(draw(g, block))
    out = drawn[0] if len(drawn) == 1 else torch.cat(drawn)
    offset = start - first * block
    return out[offset : offset + count]


def positional_randn(
    start: int, count: int, shape: tuple[int, ...], parts: tuple[int, ...], block: int, device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Standard normals of shape (count, *shape) for positions [start, start + count): the same numbers for a
    position whichever slice it is drawn in, given the same parts and block."""
    device = torch.device(device)
    return _blocks(lambda g, n: torch.randn((n, *shape), generator=g, device=device, dtype=dtype),
                   start, count, block, parts, device)


def positional_rand(
    start: int, count: int, shape: tuple[int, ...], parts: tuple[int, ...], block: int, device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Uniforms in [0, 1), as positional_randn."""
    device = torch.device(device)
    return _blocks(lambda g, n: torch.rand((n, *shape), generator=g, device=device, dtype=dtype),
                   start, count, block, parts, device)


def positional_randint(
    high: int, start: int, count: int, parts: tuple[int, ...], block: int, device: torch.device | str,
) -> torch.Tensor:
    """Integers in [0, high), one per position (int64), as positional_randn."""
    device = torch.device(device)
    return _blocks(lambda g, n: torch.randint(high, (n,), generator=g, device=device), start, count, block, parts, device)
