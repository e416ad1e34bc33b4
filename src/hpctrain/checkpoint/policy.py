"""Which checkpoint a run starts from (ckpt.resume), when to save, and what to keep. Only the choice reads the
checkpoints' manifests (storage.py); the rest is arithmetic, tested without files. The launcher, `slurm submit`,
export and sample make the choice without a Checkpointer."""

from __future__ import annotations

from pathlib import Path

from hpctrain.checkpoint import storage
from hpctrain.config.target import same_training
from hpctrain.checkpoint.storage import Checked
from hpctrain.errors import UserError


def select_checkpoint(
    root: Path, resume: str, experiment: str, verify_checksums: bool = True
) -> tuple[Checked | None, list[Checked]]:
    """Which checkpoint a run starts from, per ckpt.resume; None for a fresh start.

    Raises UserError (and deletes nothing) when the choice is impossible."""
    if resume == "never":
        existing = storage.list_checkpoints(root)
        if existing:
            raise UserError(
                f"ckpt.resume=never, but '{root}' already holds checkpoints ({existing[0].name} ...)",
                "use a new run.dir, or ckpt.resume=auto to continue that run.",
            )
        return None, []
    if resume == "auto":
        chosen, skipped = storage.find_latest_valid(root, verify_checksums)
        if chosen is None and skipped:
            reasons = "; ".join(f"{c.path.name}: {c.problem}" for c in skipped)
            raise UserError(
                f"'{root}' holds checkpoints, but none is valid ({reasons}); nothing was deleted",
                "point ckpt.resume at a good checkpoint directory, or move the run dir away and start anew.",
            )
    else:
        chosen, skipped = storage.check_checkpoint(Path(resume), verify_checksums), []
        if not chosen.valid:
            raise UserError(f"checkpoint '{resume}' is not usable: {chosen.problem}", "give another checkpoint directory.")
    if chosen is not None:
        saved_for = chosen.manifest.get("experiment") if chosen.manifest else None
        if saved_for is None or not same_training(saved_for, experiment):
            raise UserError(
                f"checkpoint '{chosen.path}' was written by experiment '{saved_for}', not '{experiment}'",
                f"use another run.dir for '{experiment}' (run.dir=...), or train '{saved_for}' to continue that run.",
            )
    return chosen, skipped


def save_due(step: int, total_steps: int, every_steps: int) -> bool:
    """Save every ``every_steps`` optimizer steps and always at the last step."""
    return step == total_steps or (every_steps > 0 and step % every_steps == 0)


def steps_to_delete(valid_steps: list[int], keep_last: int, protected: int | None) -> list[int]:
    """Older checkpoints beyond the newest ``keep_last`` valid ones; the one ``latest`` points to
    (``protected``) is never deleted, so the only valid checkpoint always survives."""
    keep = set(sorted(valid_steps, reverse=True)[:keep_last])
    if protected is not None:
        keep.add(protected)
    return sorted(s for s in valid_steps if s not in keep)
