"""Where the run is: the part of a checkpoint that is not tensors."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hpctrain.errors import UserError


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """Current epoch (0-based)."""
    step_in_epoch: int = 0
    """Optimizer steps done in the current epoch: the data position, valid for any world size
    (not for another global batch size: it counts global batches)."""
    samples_seen: int = 0
    """Training samples consumed, all ranks together."""
    global_batch_size: int = 0
    """Samples per optimizer step (train.global_batch_size) of the steps counted above: the unit of
    step_in_epoch. 0: unknown, a checkpoint written before hpctrain recorded it."""
    data_order: str = ""
    """data.order of the steps counted above (exact or shard_local): step_in_epoch points into that order. '':
    unknown, a checkpoint written before hpctrain recorded it."""
    eval_pending: bool = False
    """A stop signal at an eval step saved this checkpoint instead of validating: the resumed run validates this step
    first, so a preempted run's records equal an uninterrupted one's."""
    outputs_pending: bool = False
    """The same for the experiment's outputs (samples, figures) due at the stop's step: the resumed run makes them
    first, after the pending validation."""
    skipped_in_a_row: int = 0
    """Steps skipped for a non-finite gradient in a row up to here (train/skips.py): a resumed run stops at the same
    step as an uninterrupted one when train.max_skipped_steps is passed."""
    skipped_at: list[int] = field(default_factory=list)
    """The steps skipped since the last train record (its skipped_steps and skipped_at)."""
    log_loss: float = 0.0
    """The open log window at the save (the steps since the last train record; log.every_steps): the sum over its
    steps of the step's loss, mean over the ranks. A stop between two records writes none; the resumed run continues
    the window, so its next record averages the same steps as an uninterrupted run's, on any world size."""
    log_steps: int = 0
    """Steps in that window."""
    log_values: dict[str, list[float]] = field(default_factory=dict)
    """The open window's named values (a multi-model step's or a user loop's logs, step.log): name -> [numerator,
    denominator] summed over all ranks, the numerator and denominator of the value the next record shows (for a
    mean, as log_loss and log_steps are: over the ranks' mean; for a (sum, count), the sums)."""
    log_kinds: dict[str, str] = field(default_factory=dict)
    """Each named value's kind: mean (averaged over the ranks and steps) or ratio (a sum over a count)."""

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
        known = {k: int(data[k]) for k in ("step", "epoch", "step_in_epoch", "samples_seen")}
        known |= {"skipped_in_a_row": int(data.get("skipped_in_a_row", 0)),
                  "skipped_at": [int(s) for s in data.get("skipped_at", [])]}
        return cls(**known, global_batch_size=int(data.get("global_batch_size", 0)),
                   data_order=str(data.get("data_order", "")), eval_pending=bool(data.get("eval_pending", False)),
                   outputs_pending=bool(data.get("outputs_pending", False)),
                   log_loss=float(data.get("log_loss", 0.0)), log_steps=int(data.get("log_steps", 0)),
                   log_values={str(k): [float(x) for x in v] for k, v in data.get("log_values", {}).items()},
                   log_kinds={str(k): str(v) for k, v in data.get("log_kinds", {}).items()})


def read_state(path: Path) -> TrainState | None:
    """A checkpoint directory's train state (its state.json), or None when unreadable (the checksum verification
    of the resume that follows reports it)."""
    try:
        return TrainState.from_dict(json.loads((path / "state.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def continue_with_batch(
    saved: TrainState, global_batch_size: int, on_change: str, source: str, total_steps: int
) -> tuple[TrainState, str]:
    """The state a resumed launch continues from with its train.global_batch_size, and a warning to log
    ('' when none). Raises UserError when the batch changed and on_change (ckpt.on_batch_change) is
    'error': the saved data position counts batches of the old size, so it would silently point elsewhere."""
    now = replace(saved, global_batch_size=global_batch_size)
    if saved.global_batch_size == global_batch_size:
        return now, ""
    if saved.global_batch_size == 0:
        # Refusing would strand every run saved before the field existed; its config.toml still says.
        return now, (
            f"checkpoint '{source}' does not record train.global_batch_size (written by an older hpctrain), so a "
            f"change cannot be detected; if it differs from {global_batch_size}, the data position is wrong: "
            f"compare with train.global_batch_size in {source}/config.toml"
        )
    if on_change != "restart_epoch":
        raise _batch_changed(saved, global_batch_size, source)
    return replace(now, step_in_epoch=0), _restart_warning(saved, global_batch_size, total_steps)


def _batch_changed(saved: TrainState, global_batch_size: int, source: str) -> UserError:
    old, e = saved.global_batch_size, saved.epoch
    return UserError(
        f"train.global_batch_size changed: checkpoint '{source}' was saved with {old}, this launch has "
        f"{global_batch_size}. Its data position ({saved.step_in_epoch} steps into epoch {e}) counts batches of "
        f"{old}, so it cannot continue with {global_batch_size}; nothing was changed",
        f"resume with train.global_batch_size={old}; or start a new run (another run.dir); or set "
        f"ckpt.on_batch_change=restart_epoch to start epoch {e} again from its first sample with batches of "
        f"{global_batch_size} (the step count, and the learning-rate schedule, which is in steps, continue).",
    )


def _restart_warning(saved: TrainState, global_batch_size: int, total_steps: int) -> str:
    old, e, done = saved.global_batch_size, saved.epoch, saved.step_in_epoch
    repeated = f"its first {done * old} samples (the {done} steps done in it) are seen again" if done else "no sample repeats"
    return (
        f"train.global_batch_size changed from {old} to {global_batch_size} (ckpt.on_batch_change=restart_epoch): "
        f"epoch {e} starts again from its first sample with the new batch; {repeated}. The step count continues "
        f"from step {saved.step}, so the learning-rate schedule, which is in steps, continues at step {saved.step} "
        f"of {total_steps}, and the run ends at step {total_steps}"
    )
