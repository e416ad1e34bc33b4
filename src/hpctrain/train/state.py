"""Where the run is: the part of a checkpoint that is not tensors."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """Current epoch (0-based)."""
    step_in_epoch: int = 0
    """Optimizer steps done in the current epoch: the data position, valid for any world size."""
    samples_seen: int = 0
    """Training samples consumed, all ranks together."""

    def advance(self, global_batch_size: int, steps_per_epoch: int) -> None:
        self.step += 1
        self.step_in_epoch += 1
        self.samples_seen += global_batch_size
        if self.step_in_epoch == steps_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainState":
        return cls(**{k: int(data[k]) for k in ("step", "epoch", "step_in_epoch", "samples_seen")})
