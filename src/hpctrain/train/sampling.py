"""The worker side of `hpctrain sample RUN_DIR` (commands/sample.py): a trained run's outputs (its experiment's
outputs hook: a grid of samples) drawn again from a checkpoint, on each of 1 or N processes.

Every rank loads the checkpoint's shipped weights (the EMA ones when present) and draws its share; rank 0 writes
the PNGs under the out dir and prints their paths. Nothing else is written: no metrics.jsonl, no TensorBoard,
nothing under checkpoints/.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from hpctrain.config.schema import RunConfig
from hpctrain.errors import UserError
from hpctrain.experiments import Experiment
from hpctrain.metrics.sinks import MetricsLogger, PngSink

log = logging.getLogger("hpctrain")


def check_out_dir(out: Path, run_dir: Path) -> None:
    """The PNGs never go into the run's checkpoints, over the run's own pictures, or onto a file."""
    for kept in ("checkpoints", "images"):
        folder = (run_dir / kept).resolve()
        if out.resolve() == folder or folder in out.resolve().parents:
            raise UserError(f"--out '{out}' lies inside the run's {kept}/ (written by training)",
                            "choose another folder, e.g. RUN_DIR/samples (the default).")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out '{out}' is a file", "give a folder (it is created if missing).")


class RecordingPngSink(PngSink):
    """A PngSink that remembers the files it wrote (to print them)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, strict=True)  # the pictures are the point: a failed write is an error
        self.written: list[Path] = []

    def write_image(self, tag: str, step: int, image: np.ndarray) -> Path | None:
        path = super().write_image(tag, step, image)
        if path is not None:
            self.written.append(path)
        return path


def draw(cfg: RunConfig, runtime, experiment: Experiment, out_dir: Path) -> list[Path]:
    """Collective: load the checkpoint's shipped weights on every rank, run the outputs hook, return the PNGs
    rank 0 wrote (empty on the other ranks)."""
    from hpctrain.checkpoint.manager import Checkpointer
    from hpctrain.experiments.outputs import Outputs, run_outputs
    from hpctrain.train.precision import resolve_precision

    check_out_dir(out_dir, Path(cfg.run_dir))
    model = experiment.build_model().to(runtime.device)
    # Only restore_weights is called: it reads, and never writes or prunes checkpoints (config_text unused).
    checkpointer = Checkpointer(Path(cfg.run_dir), cfg.experiment, runtime, "", cfg.ckpt.keep_last)
    loaded = checkpointer.restore_weights(cfg.ckpt.resume, model)
    sink = RecordingPngSink(out_dir)
    metrics = MetricsLogger([sink] if runtime.is_main else [])
    precision = resolve_precision(cfg.train.precision, runtime.device)
    if runtime.is_main:
        log.info("sampling %s at step %d (%s) on %d process(es) into %s", cfg.experiment, int(loaded.info["step"]),
                 loaded.path, runtime.world_size, out_dir)
    out = Outputs(runtime, int(loaded.info["step"]), int(loaded.info["epoch"]), True, cfg.run.seed, Path(cfg.run_dir), metrics,
                  autocast=precision.autocast)
    run_outputs(experiment.outputs, model, out)
    return sink.written


def sample_here(cfg: RunConfig, runtime, experiment_cls: type[Experiment], out_dir: str) -> int:
    """This process's part of `hpctrain sample` (inside the process group); rank 0 prints the PNG paths.
    Sampling reads no memory format: the outputs hook makes its own tensors."""
    written = draw(cfg, runtime, experiment_cls(cfg), Path(out_dir) if out_dir else Path(cfg.run_dir) / "samples")
    if runtime.is_main:
        if not written:
            log.warning("the outputs hook of '%s' wrote no image", cfg.experiment)
        for path in written:
            print(path, flush=True)
    return 0
