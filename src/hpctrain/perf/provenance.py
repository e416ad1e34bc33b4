"""Which source a measurement came from: the commit, marked when the working tree has changes (for benchmark
table headers and gpu-check's environment record)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _git(root: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30, cwd=root)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def source_commit(root: Path) -> str:
    """'abcdef123456', 'abcdef123456+changes' with uncommitted changes, '' outside a git checkout."""
    head = _git(root, "rev-parse", "--short=12", "HEAD")
    return head + ("+changes" if _git(root, "status", "--porcelain") else "") if head else ""
