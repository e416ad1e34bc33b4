"""When to save and what to keep; no I/O here, so it is tested without files."""

from __future__ import annotations


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
