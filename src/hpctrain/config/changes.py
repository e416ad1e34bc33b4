"""Which settings of a run differ from those its checkpoint was saved with (the checkpoint's config.toml).

Here, in the config layer, because the resume's log (train/resume_settings.py), the hint of a checkpoint that does not
fit (checkpoint/manager.py) and `hpctrain slurm submit`'s checks all compare the same way, and checkpoint/ imports
nothing of train/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpctrain.config.load import flat_differences

BOOKKEEPING = ("run.dir", "run.name", "ckpt.resume", "train.stop_at_step", "log.progress", "slurm.", "alert.")
"""Keys (or sections, ending in '.') that say where a run is and how a launch is started or watched, not what it
trains: a resume from another path, each chunk's own train.stop_at_step, a job with more time are not changed
settings of the run."""


def saved_config(checkpoint: Path) -> str | None:
    """The checkpoint's config.toml; None when it cannot be read (missing, unreadable, not UTF-8)."""
    try:
        return (checkpoint / "config.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def setting_changes(saved_text: str, config_text: str) -> list[tuple[str, Any, Any]]:
    """(key, saved value, this launch's) for each setting that differs, BOOKKEEPING keys left out; none when either
    text is not TOML."""
    return [(key, then, now) for key, then, now in flat_differences(saved_text, config_text)
            if not any(key == k or (k.endswith(".") and key.startswith(k)) for k in BOOKKEEPING)]
