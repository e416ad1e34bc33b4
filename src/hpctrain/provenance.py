"""Which source and machine a measurement came from: the commit, marked when the working tree has changes, and the
CPU model (for benchmark table headers, gpu-check's environment record and the compile cache's key)."""

from __future__ import annotations

import platform
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


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, e.g. 'Intel(R) Xeon(R) Processor'; the architecture elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()
