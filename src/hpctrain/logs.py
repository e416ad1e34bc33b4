"""Rank-aware logging: rank 0 tells the story, other ranks speak only for warnings and errors."""

from __future__ import annotations

import collections
import logging
import sys

_RECENT: collections.deque[str] = collections.deque(maxlen=50)


class _RecentLines(logging.Handler):
    """Keeps the last log lines of this process, for alerts ('what happened just before')."""

    def emit(self, record: logging.LogRecord) -> None:
        _RECENT.append(self.format(record))


def recent_log_lines(n: int = 20) -> list[str]:
    return list(_RECENT)[-n:]


def forget_recent_lines() -> None:
    """A worker forked from the launcher starts without the launcher's lines (launcher/forked_workers)."""
    _RECENT.clear()


def setup_logging(rank: int = 0, world_size: int = 1, hostname: str = "", debug: bool = False) -> None:
    who = f" [rank {rank}/{world_size} {hostname}]" if world_size > 1 else ""
    level = logging.DEBUG if debug else logging.INFO if rank == 0 else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s{who} %(message)s", "%H:%M:%S"))
    recent = _RecentLines()
    recent.setFormatter(handler.formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler, recent]
    root.setLevel(level)
