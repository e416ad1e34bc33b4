"""``data.order=shard_local``: each rank reads its own shards, so a node reads about 1/nodes of the data per epoch.

The exact order (:func:`hpctrain.data.shardset.shard_epoch_order`) makes the samples of step k independent of the
number of processes; its price is that every node reads (nearly) the whole data set every epoch. This order is
WebDataset's instead, made deterministic and resumable (shard_local_order says how): the epoch's shards dealt to
the ranks, each rank's stream shuffled within windows, and equal step counts so no rank waits at an epoch's end.

It is expressed as a global order for :class:`hpctrain.data.sampler.StepBatchSampler`: step k's slice holds rank 0's
``per_rank`` samples of step k, then rank 1's, and so on. The sampler, the position in an epoch (steps done) and the
resume stay what they are; the order is a function of (seed, epoch, world size, per-rank batch), so it is exact at a
fixed world size and changes with it (see :func:`data_order_warning`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from typing import NamedTuple, Sequence

import torch

from hpctrain.data.seeding import SALT_SHARD_LOCAL, generator

# Sub-streams of SALT_SHARD_LOCAL: the deal of an epoch, and each rank's window shuffle.
DEAL, WINDOWS = 0, 1


class RankLayout(NamedTuple):
    """What the shard-local order depends on besides (seed, epoch)."""

    world_size: int
    per_rank: int
    """Samples each rank takes per optimizer step (micro batch x accumulation)."""


def deal_shards(sizes: Sequence[int], world_size: int, g: torch.Generator | None) -> list[list[int]]:
    """The shards of each rank for one epoch: permuted (unless g is None), each to the least-loaded rank."""
    order = torch.randperm(len(sizes), generator=g).tolist() if g is not None else list(range(len(sizes)))
    owned: list[list[int]] = [[] for _ in range(world_size)]
    loads = [(0, r) for r in range(world_size)]  # a heap of (samples held, rank): ties go to the lower rank
    for shard in order:
        load, r = heapq.heappop(loads)
        owned[r].append(shard)
        heapq.heappush(loads, (load + int(sizes[shard]), r))
    return owned


def shard_starts(sizes: Sequence[int]) -> list[int]:
    """Index of each shard's first sample in the concatenated shards, and the total at the end."""
    return [0, *itertools.accumulate(int(n) for n in sizes)]


def shard_stream(starts: Sequence[int], shards: Sequence[int]) -> torch.Tensor:
    """The samples of ``shards``, in that order (``starts`` from shard_starts)."""
    return torch.cat([torch.arange(starts[s], starts[s + 1]) for s in shards] or [torch.arange(0)])


def window_shuffle(stream: torch.Tensor, window: int, g: torch.Generator) -> torch.Tensor:
    """Shuffle within windows of ``window`` consecutive samples; the first window's length is drawn too, so window
    boundaries move from epoch to epoch (a deterministic shuffle buffer)."""
    total = len(stream)
    if window <= 1 or total == 0:
        return stream
    window = min(window, total)
    first = int(torch.randint(0, window, (1,), generator=g)) if total > window else window
    cuts = [0, *range(first, total, window), total]
    pieces = [stream[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
    return torch.cat([p[torch.randperm(len(p), generator=g)] for p in pieces])


def shard_local_order(sizes: Sequence[int], seed: int, epoch: int, window: int, layout: RankLayout,
                      shuffle: bool = True) -> torch.Tensor:
    """The epoch's global order (indices into the concatenated shards) under data.order=shard_local.

    1. The epoch's shards are permuted from (seed, epoch) and dealt to the ranks one by one, each to the rank that
    holds the fewest samples so far (with equal shards: round robin). 2. Each rank's stream is its shards
    concatenated, shuffled within windows of ``window`` samples (the shuffle buffer), from (seed, epoch, rank). 3.
    Equal step counts. Every rank takes ``steps x per_rank`` samples, steps = samples // global batch (the partial
    last global batch is dropped, as in the exact order). A rank holding more hands the end of its stream to ranks
    holding fewer, which append it to theirs: with equal shards that is at most one shard's samples per rank, read
    from another rank's shard at the end of the epoch. So no rank waits at the end of an epoch, and every sample
    (but the dropped remainder) is seen once per epoch across the ranks."""
    world, per_rank = layout
    starts = shard_starts(sizes)
    g = generator(SALT_SHARD_LOCAL, DEAL, seed, epoch) if shuffle else None
    streams = []
    for rank, shards in enumerate(deal_shards(sizes, world, g)):
        stream = shard_stream(starts, shards)
        if shuffle:
            stream = window_shuffle(stream, window, generator(SALT_SHARD_LOCAL, WINDOWS, seed, epoch, rank))
        streams.append(stream)
    steps = starts[-1] // (world * per_rank)
    rank_parts, dropped = equalise(streams, steps * per_rank)
    by_step = torch.stack(rank_parts).reshape(world, steps, per_rank).transpose(0, 1)  # step k: rank 0's, rank 1's..
    return torch.cat([by_step.reshape(-1), dropped])


def equalise(streams: list[torch.Tensor], take: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every stream cut or filled to ``take`` samples: the surplus ends of the longer streams, in rank order, fill
    the shorter ones; what is left over (fewer than a global batch) is returned as dropped."""
    surplus = torch.cat([s[take:] for s in streams] or [torch.arange(0)])
    out, used = [], 0
    for s in streams:
        need = take - min(len(s), take)
        out.append(torch.cat([s[:take], surplus[used : used + need]]))
        used += need
    return out, surplus[used:]


def data_order_warning(epoch: int, step_in_epoch: int, saved_order: str, order: str, saved_world: int, world: int) -> str:
    """What a resume changes in the rest of the saved epoch ('' when nothing): the position counts steps of the saved
    order, which the exact order keeps for any number of processes, and shard_local only for the same number."""
    if step_in_epoch == 0:
        return ""  # the epoch starts from its first step: every epoch is complete
    saved_order = saved_order or "exact"  # checkpoints written before the field existed had only this order
    if saved_order != order:
        cause = f"the checkpoint was written with data.order={saved_order}, this run has data.order={order}"
        fix = f"set data.order={saved_order}"
    elif order == "shard_local" and saved_world != world:
        cause = (f"the checkpoint was written by {saved_world} process(es), this run has {world}, and the "
                 "shard-local order depends on the number of processes")
        fix = f"resume on {saved_world} process(es), or use data.order=exact next time"
    else:
        return ""
    return (f"{cause}. The rest of epoch {epoch} (from its step {step_in_epoch}) follows this run's order: until the "
            "epoch ends, some samples already seen in it are seen again and others not at all; the epochs after it "
            f"are complete. For an exact continuation, {fix}.")


def borrowed_share(shards: int, ranks: int) -> float:
    """How much of an epoch is read from another rank's shard, for shards of equal size: ranks hold floor(S/R) or
    one more, and those holding fewer borrow up to the difference to the mean (less where the dropped partial
    global batch comes out of it). 0 for a multiple of R."""
    held, extra = divmod(shards, ranks)
    if held == 0:
        return (ranks - shards) / ranks  # ranks without a shard borrow all they read
    return (ranks - extra) * (extra / ranks) / shards


def shard_local_summary(sizes: Sequence[int], world_size: int) -> tuple[int, str]:
    """(logging level, text) for the start of a shard_local run: how the shards are dealt, what equal step counts
    cost, and a warning when so much is borrowed that reads are no longer local."""
    shards, samples = len(sizes), sum(int(n) for n in sizes)
    share = borrowed_share(shards, world_size)
    # Dealt to the least-loaded rank, loads differ by at most the largest shard: so does any rank's shortfall.
    text = (f"data.order=shard_local: {shards} shards ({samples} samples) dealt to {world_size} ranks per epoch; "
            f"up to about {share:.0%} of an epoch (at most {max(int(n) for n in sizes)} samples a rank, the largest shard) "
            "is read from another rank's shard, to keep step counts equal")
    if share > MAX_BORROWED:
        return logging.WARNING, (
            f"{text}. Those reads are scattered over the other rank's blocks, so they cost more than their share: "
            f"write a multiple of {world_size} shards, e.g. {good_shard_count(shards, world_size)} (hpctrain shard "
            "--shard-size), or use data.order=exact.")
    return logging.INFO, text


MAX_BORROWED = 0.1
"""Above this share of borrowed samples, the start-up log and hpctrain slurm check warn."""


def good_shard_count(shards: int, ranks: int) -> int:
    """The next multiple of the ranks: equal shards, equal shares, nothing borrowed."""
    return ranks * max(1, -(-shards // ranks))
