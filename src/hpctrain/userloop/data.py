"""The training data of a user's loop: a map-style data set in hpctrain's exact order, or the user's own iterable.

A map-style data set (``__len__`` and ``__getitem__``) goes through hpctrain's step sampler and loader: the samples
of step k depend only on (seed, epoch, k, global batch), whatever the number of processes, and a resume continues
from the saved position exactly, on any world size (data/sampler.py).

Anything else (a DataLoader with its own sampler, an IterableDataset, a generator) is the user's: each micro-batch
is the next item it yields on this rank. hpctrain cannot know its order, so the guarantees that hold are fewer and
said at the start: at each epoch it calls the sampler's ``set_epoch(epoch)`` where there is one (torch's
DistributedSampler), and a resume skips the micro-batches of the epoch already trained, which lands on the same
samples only when the order depends on the epoch alone (DistributedSampler with set_epoch at one world size: yes;
``shuffle=True``, drawn from the global RNG when iterated: no). A loader's own state_dict (torchdata's
StatefulDataLoader) is not used: it is each rank's, and a registered object's state is rank 0's.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Iterable, Iterator

from hpctrain.config.batch import BatchSizes
from hpctrain.userloop.objects import misuse

log = logging.getLogger("hpctrain")


def is_map_style(data: Any) -> bool:
    """A data set hpctrain samples itself: indexable with a length, and no loader or iterable data set."""
    from torch.utils.data import DataLoader, IterableDataset

    return (hasattr(data, "__getitem__") and hasattr(data, "__len__")
            and not isinstance(data, (DataLoader, IterableDataset)))


class OwnOrder:
    """Stands in for the step sampler with a user's iterable: the epoch's length in steps and the position to start
    from (the loop sets it as it sets the sampler's)."""

    def __init__(self, data: Any, plan: BatchSizes, max_steps: int) -> None:
        self.data = data
        self.batches = plan
        try:
            micro_batches = len(data)
        except TypeError:  # an iterable without a length: one epoch lasts train.max_steps
            if not max_steps:
                raise misuse(f"run.steps got a {type(data).__name__} without a length, and train.max_steps is 0",
                             "set train.max_steps (the run's length in optimizer steps), or give a data set with a "
                             "length.") from None
            micro_batches = max_steps * plan.grad_accum
        self.steps_per_epoch = micro_batches // plan.grad_accum
        if self.steps_per_epoch == 0:
            raise misuse(f"run.steps: the data yields {micro_batches} micro-batch(es) per epoch on this rank, "
                         f"fewer than one step's {plan.grad_accum}", "give more data, or a larger "
                         "train.micro_batch_size for the same global batch (fewer accumulation steps).")
        self.epoch = self.start_step = 0

    def set_position(self, epoch: int, step_in_epoch: int) -> None:
        self.epoch, self.start_step = epoch, step_in_epoch


class OwnLoader:
    """Iterating it runs one epoch of the user's iterable from the position OwnOrder holds, in micro-batches."""

    def __init__(self, order: OwnOrder) -> None:
        self.order = order

    def take_skipped(self) -> list[str]:
        """No samples skipped that hpctrain knows of (data.on_error=skip is the loader's; this is the user's)."""
        return []

    def __iter__(self) -> Iterator[Any]:
        order, data = self.order, self.order.data
        for owner in (data, getattr(data, "sampler", None), getattr(data, "batch_sampler", None),
                      getattr(getattr(data, "batch_sampler", None), "sampler", None)):
            if callable(getattr(owner, "set_epoch", None)):
                owner.set_epoch(order.epoch)
                break
        skip = order.start_step * order.batches.grad_accum
        if skip:
            log.warning("resuming a loop over its own data (%s): skipping the %d micro-batches of epoch %d already "
                        "trained; the same samples only if its order depends on the epoch alone",
                        type(data).__name__, skip, order.epoch)
        total = order.steps_per_epoch * order.batches.grad_accum
        return itertools.islice(iter(data), skip, total)


def own_data_warning(data: Iterable) -> str:
    """The start-up line for a user's own data: which guarantees do not hold."""
    return (f"run.steps over a {type(data).__name__} of its own: its order is the iterable's (not world-size "
            "independent), and a resume skips the epoch's trained micro-batches, which are the same samples only "
            "if its order depends on the epoch alone; a map-style data set gets hpctrain's exact order "
            "(docs/bring-your-own.md)")
