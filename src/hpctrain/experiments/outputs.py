"""What an experiment's ``outputs`` hook gets: its share of the work, a gather to rank 0, and the image sink.

The hook runs on every rank, so 64 (or 50,000) samples take 1/N of the time on N ranks. Each rank works on a
contiguous share of the items, the shares are gathered on rank 0 in rank order, so item i is the same whatever
the number of processes (given per-item randomness: ``randn``). Rank 0 then writes; the others wait on the
control plane (dist.control_timeout_s), not in the next step's gradient all-reduce (dist.timeout_s).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ContextManager

import torch

from hpctrain.data.positional import positional_randn
from hpctrain.dist.collectives import barrier, gather_tensor_to_main
from hpctrain.dist.runtime import Runtime
from hpctrain.metrics.images import image_grid
from hpctrain.metrics.sinks import MetricsLogger

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("hpctrain")

SAMPLE_BLOCK = 64
"""Per-item draws come in blocks of this many items: independent of the world size."""


@dataclass
class Outputs:
    runtime: Runtime
    """The process group (rank, world size, device)."""
    step: int
    """Optimizer steps done."""
    epoch: int
    """Current epoch."""
    final: bool
    """True at the end of the run."""
    seed: int
    """run.seed: per-item randomness derives from it (randn)."""
    run_dir: Path
    """The run directory (rank 0 writes into it)."""
    metrics: MetricsLogger
    """Rank 0's sinks (PNG files, TensorBoard, metrics.jsonl); none on the other ranks."""
    beat: Callable[[], None] = lambda: None
    """The rank's heartbeat: call it in long loops (a sampling step), so the watchdog sees progress."""
    autocast: Callable[[], ContextManager] = contextlib.nullcontext
    """The run's mixed-precision context (train.precision), for the hook's forward passes."""

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    def share(self, n: int) -> range:
        """This rank's contiguous part of items 0..n-1 (sizes differ by at most one)."""
        r, w = self.runtime.rank, self.runtime.world_size
        return range(r * n // w, (r + 1) * n // w)

    def randn(self, items: range, *shape: int, stream: int = 0) -> torch.Tensor:
        """Standard normals (len(items), *shape) on the device for these items, the same whichever rank draws
        them (seeded by run.seed, stream and the item's position; use a new stream for each draw)."""
        return positional_randn(items.start, len(items), tuple(shape), (self.seed, 2, stream), SAMPLE_BLOCK,
                                self.device)

    def gather(self, part: torch.Tensor) -> torch.Tensor | None:
        """Every rank's part concatenated in rank order (so in item order, with share), on rank 0, on the CPU;
        None on the other ranks. Collective: every rank calls it, with parts of equal trailing shape and dtype."""
        return gather_tensor_to_main(part, self.runtime)

    def image(self, tag: str, images: torch.Tensor | None, nrow: int = 0) -> Path | None:
        """Rank 0: N x C x H x W floats in [0, 1] as one grid, to RUN_DIR/images/TAG/step_NNNNNNN.png and
        TensorBoard; returns the PNG's path. Other ranks (and images None): nothing."""
        if not self.runtime.is_main or images is None:
            return None
        path = self.metrics.image(tag, self.step, image_grid(images, nrow))
        if path is not None:
            log.info("%s: %s", tag, path)
        return path

    def picture(self, tag: str, picture: "np.ndarray | None") -> Path | None:
        """Rank 0: an H x W x 3 uint8 picture as it is (a figure with axes and a legend), like image. Other ranks
        (and None): nothing."""
        if not self.runtime.is_main or picture is None:
            return None
        path = self.metrics.image(tag, self.step, picture)
        if path is not None:
            log.info("%s: %s", tag, path)
        return path

    def log(self, **values: float) -> None:
        """Scalars (e.g. a sample-quality score) into metrics.jsonl with split 'outputs' (rank 0 only)."""
        self.metrics.log({"step": self.step, "split": "outputs", "epoch": self.epoch, **values})


def run_outputs(hook: Callable[[torch.nn.Module, Outputs], None], model: torch.nn.Module, out: Outputs) -> None:
    """Call the hook in eval mode without gradients, then wait on the control plane for rank 0's files."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            hook(model, out)
    finally:
        model.train(was_training)
    barrier(out.runtime)
