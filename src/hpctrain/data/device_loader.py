"""data.on_device: the whole training set in device memory, micro-batches cut there.

For small data sets at GPU speed (CIFAR-10: 50,000 x 3 x 32 x 32 uint8 = 150 MB) a loader's workers, its
collation and the host-to-device copy of each batch are the step's overhead, not its work. Here the tensors go
to the device once; each epoch's order (the same permutation the loader path uses, from the sampler) goes once
per epoch; a micro-batch is an index into them, and augmentation runs batched on the device with uniforms drawn
per (seed, epoch, sample index) for the whole epoch at once, so the batches do not depend on the number of
processes either. Nothing synchronises the device per step.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Dataset

from hpctrain.data.sampler import StepBatchSampler
from hpctrain.data.seeding import mix_seed
from hpctrain.errors import UserError

SALT_DEVICE_AUGMENT = 6


def dataset_tensors(dataset: Dataset, experiment: str) -> tuple[torch.Tensor, ...]:
    tensors = getattr(dataset, "tensors", None)
    if not isinstance(tensors, tuple) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise UserError(
            f"data.on_device=true needs the training set as tensors, and experiment '{experiment}' gives a "
            f"{type(dataset).__name__}",
            "set data.on_device=false (the loader path), or build the training set as a "
            "torch.utils.data.TensorDataset when data.on_device is set.",
        )
    return tensors


class DeviceLoader:
    """The loader interface the loop uses (iter from the sampler's position, len, take_skipped)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], sampler: StepBatchSampler, device: torch.device, seed: int,
                 transform: Callable[[Any, torch.Tensor], Any] | None, draws: int) -> None:
        self.tensors = tuple(t.to(device) for t in tensors)
        self.sampler = sampler
        self.device = device
        self.seed = seed
        self.transform = transform
        self.draws = draws

    def __len__(self) -> int:
        return len(self.sampler)

    def epoch_uniforms(self, epoch: int) -> torch.Tensor:
        """N x draws uniforms for the epoch: row i belongs to sample i, whichever rank takes it."""
        g = torch.Generator(device=self.device)
        g.manual_seed(mix_seed(SALT_DEVICE_AUGMENT, self.seed, epoch))
        return torch.rand((self.sampler.num_samples, self.draws), generator=g, device=self.device)

    def __iter__(self) -> Iterator[Any]:
        s, plan = self.sampler, self.sampler.batches
        order = s.order(s.seed, s.epoch, s.shuffle).to(self.device)
        uniforms = self.epoch_uniforms(s.epoch) if self.transform is not None else None
        m = plan.micro_batch_size
        for step in range(s.start_step, s.steps_per_epoch):
            begin = step * plan.global_batch_size + s.rank * plan.per_rank
            for i in range(begin, begin + plan.per_rank, m):
                index = order[i : i + m]
                batch = tuple(t[index] for t in self.tensors)
                yield batch if uniforms is None else self.transform(batch, uniforms[index])

    def take_skipped(self) -> list[str]:
        return []  # tensors in memory: nothing unreadable to skip
