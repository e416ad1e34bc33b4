"""Batch arithmetic, in one place: accumulation is computed from the world size, never configured.

global_batch = micro_batch x world_size x grad_accum. Changing the number of
processes changes grad_accum and keeps the global batch, so the optimisation
(and the data of each optimizer step) stays the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.errors import UserError


@dataclass(frozen=True)
class BatchSizes:
    global_batch_size: int
    """Samples per optimizer step, all ranks together."""
    micro_batch_size: int
    """Samples per rank per forward/backward."""
    world_size: int
    """Number of processes sharing each step."""
    grad_accum: int
    """Micro-steps per optimizer step on each rank."""

    @property
    def per_rank(self) -> int:
        """Samples each rank consumes per optimizer step."""
        return self.micro_batch_size * self.grad_accum


def valid_micro_batch_sizes(global_batch_size: int, world_size: int) -> list[int]:
    if global_batch_size % world_size:
        return []
    per_rank = global_batch_size // world_size
    return [m for m in range(1, per_rank + 1) if per_rank % m == 0]


def batch_sizes(global_batch_size: int, micro_batch_size: int, world_size: int) -> BatchSizes:
    """grad_accum = global / (micro x world); a UserError with valid choices when it does not divide."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if global_batch_size % world_size:
        raise UserError(
            f"train.global_batch_size={global_batch_size} cannot be split evenly across {world_size} processes",
            f"use a global batch that is a multiple of {world_size} "
            f"(e.g. {max(world_size, global_batch_size - global_batch_size % world_size)}), or another number of processes.",
        )
    per_rank = global_batch_size // world_size
    if per_rank % micro_batch_size:
        raise UserError(
            f"train.micro_batch_size={micro_batch_size} does not divide the {per_rank} samples each of "
            f"{_processes(world_size)} takes per step (train.global_batch_size={global_batch_size})",
            micro_batch_hint(global_batch_size, world_size) + ".",
        )
    return BatchSizes(global_batch_size, micro_batch_size, world_size, per_rank // micro_batch_size)


def micro_batch_hint(global_batch_size: int, world_size: int = 1) -> str:
    """The valid train.micro_batch_size values, for every error about one: 1 process as N (README "Batch sizes")."""
    choices = valid_micro_batch_sizes(global_batch_size, world_size)
    return f"valid train.micro_batch_size values for {_processes(world_size)}: {_short_list(choices)}"


def _processes(n: int) -> str:
    return "1 process" if n == 1 else f"{n} processes"


def steps_per_epoch(num_samples: int, global_batch_size: int) -> int:
    """Full optimizer steps in one epoch (training drops the last partial global batch)."""
    steps = num_samples // global_batch_size
    if steps == 0:
        raise UserError(
            f"the training set has {num_samples} samples, fewer than one global batch ({global_batch_size})",
            "lower train.global_batch_size or use a larger dataset.",
        )
    return steps


def _short_list(values: list[int]) -> str:
    return ", ".join(map(str, values)) if len(values) <= 12 else ", ".join(map(str, values[:12])) + ", ..."
