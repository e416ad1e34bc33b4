"""Which checkpoint a launch would start from, checked against its config before any process starts: the local
launch checks it, and so does `hpctrain slurm submit` before sbatch (a refusal after the queue wait would come
from every rank). Cheap checks only: the workers verify checksums before loading."""

from __future__ import annotations

from pathlib import Path

from hpctrain.checkpoint.policy import select_checkpoint
from hpctrain.config.schema import RunConfig
from hpctrain.train.resume_settings import refuse_fixed_changes
from hpctrain.train.state import continue_with_batch, read_state


def chosen_checkpoint(cfg: RunConfig) -> Path | None:
    """The checkpoint ckpt.resume names in the run dir (None for a fresh start); a UserError when it names one
    that is not there (eval and sample read one without training on)."""
    chosen, _ = select_checkpoint(Path(cfg.run_dir) / "checkpoints", cfg.ckpt.resume, cfg.experiment,
                                  verify_checksums=False)
    return chosen.path if chosen is not None else None


def check_resume(cfg: RunConfig) -> Path | None:
    """The checkpoint training would continue from, refused when the config cannot continue it: a changed
    train.global_batch_size (by ckpt.on_batch_change), or a setting fixed for a run (optim.name: the checkpoint's
    optimizer state belongs to it). Returns its path (None for a fresh start)."""
    path = chosen_checkpoint(cfg)
    if path is not None:
        _check_saved_batch(path, cfg)
        refuse_fixed_changes(path, cfg)
    return path


def _check_saved_batch(path: Path, cfg: RunConfig) -> None:
    """A changed train.global_batch_size stops here, before any process starts or anything is written.
    Warnings wait for the restore (rank 0), so they are said once."""
    saved = read_state(path)
    if saved is not None:
        continue_with_batch(saved, cfg.train.global_batch_size, cfg.ckpt.on_batch_change, str(path), total_steps=0)
