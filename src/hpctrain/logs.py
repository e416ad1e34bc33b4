"""Rank-aware logging: rank 0 tells the story, other ranks speak only for warnings and errors."""

from __future__ import annotations

import logging
import sys


def setup_logging(rank: int = 0, world_size: int = 1, hostname: str = "", debug: bool = False) -> None:
    who = f" [rank {rank}/{world_size} {hostname}]" if world_size > 1 else ""
    level = logging.DEBUG if debug else logging.INFO if rank == 0 else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s{who} %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
