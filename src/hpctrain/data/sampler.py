"""Batch samplers with exact distributed semantics.

Training (:class:`StepBatchSampler`): the epoch's global order is a permutation drawn from (seed, epoch) alone.
Optimizer step k takes the k-th slice of ``global_batch_size`` samples of it; rank r takes the r-th contiguous part
of that slice and cuts it into ``grad_accum`` micro-batches. So the *set* of samples in each step depends only on
(seed, epoch, k, global batch), not on the number of processes or accumulation steps, and the position in an epoch
is one number (steps done) that survives a change of world size. The last partial global batch is dropped. torch's
DistributedSampler pads and shards per rank before batching, so its steps change with the world size; that is why
this is written here.

Validation (:class:`EvalBatchSampler`): the set is cut into chunks of one micro-batch, chunk c goes to rank c mod
world. No sample is padded, repeated or dropped, and each batch has the same members whatever the world size, so
per-sample results, and the all-reduced sums built from them, do not depend on it.
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple

import torch
from torch.utils.data import Sampler

from hpctrain.config.batch import BatchSizes, steps_per_epoch
from hpctrain.data.seeding import SALT_ORDER, generator


class SampleKey(NamedTuple):
    """What the train sampler yields: the epoch travels with the index so that
    augmentation can be seeded from it inside loader workers, which never see set_epoch."""

    epoch: int
    index: int


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    if not shuffle:
        return torch.arange(num_samples)
    return torch.randperm(num_samples, generator=generator(SALT_ORDER, seed, epoch))


OrderFn = Callable[[int, int, bool], torch.Tensor]
"""(seed, epoch, shuffle) -> the epoch's global order; a sharded set supplies one that keeps reads local."""


class StepBatchSampler(Sampler[list[SampleKey]]):
    def __init__(
        self, num_samples: int, plan: BatchSizes, rank: int, seed: int, shuffle: bool = True, order: OrderFn | None = None
    ) -> None:
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} outside world of {plan.world_size}")
        self.num_samples = num_samples
        self.batches = plan
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.order = order or (lambda seed, epoch, shuffle: epoch_order(num_samples, seed, epoch, shuffle))
        self.steps_per_epoch = steps_per_epoch(num_samples, plan.global_batch_size)
        self.epoch = 0
        self.start_step = 0

    def set_position(self, epoch: int, step_in_epoch: int) -> None:
        """Where the next iteration starts: call before each ``iter(loader)``."""
        if not 0 <= step_in_epoch <= self.steps_per_epoch:
            raise ValueError(f"step {step_in_epoch} outside epoch of {self.steps_per_epoch} steps")
        self.epoch, self.start_step = epoch, step_in_epoch

    def step_indices(self, order: torch.Tensor, step: int) -> list[int]:
        """This rank's samples of optimizer step ``step`` (within the epoch)."""
        p = self.batches
        begin = step * p.global_batch_size + self.rank * p.per_rank
        return order[begin : begin + p.per_rank].tolist()

    def __iter__(self) -> Iterator[list[SampleKey]]:
        order = self.order(self.seed, self.epoch, self.shuffle)
        if len(order) != self.num_samples:
            raise ValueError(f"the epoch order has {len(order)} samples, the data set {self.num_samples}")
        m = self.batches.micro_batch_size
        for step in range(self.start_step, self.steps_per_epoch):
            mine = self.step_indices(order, step)
            for i in range(0, len(mine), m):
                yield [SampleKey(self.epoch, j) for j in mine[i : i + m]]

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.batches.grad_accum


class EvalBatchSampler(Sampler[list[int]]):
    """Validation batches: runs of ``batch_size`` consecutive indices, dealt round-robin to the ranks (no padding,
    no duplicates, no drops: the metrics are exact). With ``pad`` (dist.strategy=fsdp, where every forward is a
    collective) every rank yields the same number of batches: a rank short of batches repeats the set's first
    batch, marked with start -1 (see starts), and validation discards what it computes on it."""

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, pad: bool = False) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.pad = pad

    def _own_starts(self) -> range:
        return range(self.rank * self.batch_size, self.num_samples, self.world_size * self.batch_size)

    def starts(self) -> list[int]:
        """The first index of each batch this rank yields, in order; -1 for a padding batch."""
        own = list(self._own_starts())
        return own + [-1] * (len(self) - len(own))

    def __iter__(self) -> Iterator[list[int]]:
        for start in self.starts():
            first = max(start, 0)
            yield list(range(first, min(first + self.batch_size, self.num_samples)))

    def __len__(self) -> int:
        chunks = -(-self.num_samples // self.batch_size)
        if self.pad:
            return -(-chunks // self.world_size)
        return len(range(self.rank, chunks, self.world_size))
