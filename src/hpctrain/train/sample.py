"""`hpctrain sample RUN_DIR`: a trained run's outputs (its experiment's outputs hook: a grid of samples) drawn
again from a checkpoint, on 1 or N processes, into a folder of PNGs.

The run's own config.toml says which experiment and which options; key=value overrides go on top (--n and
--ddim-steps are model.samples and model.sample_steps). Every rank loads the checkpoint's shipped weights (the
EMA ones when present) and draws its share; rank 0 writes the PNGs under --out (default RUN_DIR/samples) and
prints their paths. Nothing else is written: no metrics.jsonl, no TensorBoard, nothing under checkpoints/.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import numpy as np

from hpctrain.config.load import load_config
from hpctrain.config.schema import RunConfig
from hpctrain.errors import UserError
from hpctrain.experiments import Experiment, resolve_experiment
from hpctrain.metrics.sinks import MetricsLogger, PngSink

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger("hpctrain")

SAMPLING_KEYS = {"model.samples": "--n", "model.sample_steps": "--ddim-steps"}
"""Options `hpctrain sample` sets, and the flags that set them."""


def sample_overrides(n: int | None, ddim_steps: int | None, resume: str | None) -> tuple[str, ...]:
    """The command line's flags as key=value overrides (the form the torchrun workers receive)."""
    if n is not None and n < 1:
        raise UserError(f"--n must be at least 1, got {n}")
    if ddim_steps is not None and ddim_steps < 0:
        raise UserError(f"--ddim-steps must be 0 (ancestral sampling) or more, got {ddim_steps}")
    if resume == "never":
        raise UserError("--resume never loads no weights", "use --resume auto (the latest checkpoint) or a checkpoint "
                        "directory.")
    out: tuple[str, ...] = ()
    if n is not None:
        out += (f"model.samples={n}",)
    if ddim_steps is not None:
        out += (f"model.sample_steps={ddim_steps}",)
    if resume:
        out += (f"ckpt.resume={resume}",)
    return out


def run_config_path(run_dir: Path) -> Path:
    """RUN_DIR/config.toml, or a UserError saying why the folder is no run dir."""
    if not run_dir.is_dir():
        raise UserError(f"run directory '{run_dir}' does not exist", "give the run.dir of a trained run.")
    path = run_dir / "config.toml"
    if not path.is_file():
        raise UserError(f"'{run_dir}' has no config.toml, so it is no hpctrain run directory",
                        "give the run.dir of a trained run (it holds config.toml and checkpoints/).")
    return path


def run_experiment_name(config_path: Path) -> str:
    """The experiment a run dir's config.toml was written for (its top-level ``experiment`` key)."""
    try:
        name = tomllib.loads(config_path.read_text(encoding="utf-8")).get("experiment")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise UserError(f"cannot read '{config_path}': {err}", "it should be the config.toml hpctrain wrote.") from None
    if not isinstance(name, str) or not name:
        raise UserError(f"'{config_path}' names no experiment (experiment = \"NAME\" on its first line)",
                        "it should be the config.toml hpctrain wrote.")
    return name


def resolve_run(run_dir: Path, overrides: tuple[str, ...] = ()) -> tuple[type[Experiment], RunConfig]:
    """A run dir's experiment and config (its config.toml, the overrides on top; run.dir is RUN_DIR and
    ckpt.resume defaults to auto, whatever the run was started with)."""
    config_path = run_config_path(run_dir)
    name = run_experiment_name(config_path)
    cls = resolve_experiment(name)
    cfg = load_config(name, cls.config_class, experiment_defaults=cls.defaults, config_file=config_path,
                      overrides=("ckpt.resume=auto", *overrides, f"run.dir={run_dir}"))
    return cls, cfg


def check_can_sample(cls: type[Experiment], overrides: tuple[str, ...]) -> None:
    """A clear error for an experiment with nothing to draw, or without the sampling options asked for."""
    if cls.outputs is Experiment.outputs:
        raise UserError(f"experiment '{cls.name or cls.__name__}' has no outputs to draw (it does not implement "
                        "Experiment.outputs)", "hpctrain sample runs an experiment's outputs hook; this one has none.")
    fields = {f"model.{f.name}" for f in dataclasses.fields(cls.config_class)}
    asked = [key for key in SAMPLING_KEYS for item in overrides if item.partition("=")[0].strip() == key]
    missing = [key for key in asked if key not in fields]
    if missing:
        flags = ", ".join(f"{SAMPLING_KEYS[k]} ({k})" for k in missing)
        raise UserError(f"experiment '{cls.name or cls.__name__}' has no sampling options: {flags} cannot be set",
                        "leave them out: its outputs hook then draws what its own options say.")


def resolve_sample(run_dir: Path, overrides: tuple[str, ...]) -> tuple[type[Experiment], RunConfig]:
    """resolve_run, after checking that the run's experiment can be sampled as asked."""
    from hpctrain.checkpoint.policy import select_checkpoint

    cls = resolve_experiment(run_experiment_name(run_config_path(run_dir)))
    check_can_sample(cls, overrides)
    cls, cfg = resolve_run(run_dir, overrides)
    # Cheap (no checksums), before any process starts: a run dir without a checkpoint has no weights to draw with.
    chosen, _ = select_checkpoint(run_dir / "checkpoints", cfg.ckpt.resume, cfg.experiment, verify_checksums=False)
    if chosen is None:
        raise UserError(f"no checkpoint in '{run_dir / 'checkpoints'}'",
                        "train first, or point --resume at a checkpoint directory.")
    return cls, cfg


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


def sample_here(cfg: RunConfig, runtime, experiment: Experiment, out_dir: str) -> int:
    """This process's part of `hpctrain sample` (inside the process group); rank 0 prints the PNG paths."""
    written = draw(cfg, runtime, experiment, Path(out_dir) if out_dir else Path(cfg.run_dir) / "samples")
    if runtime.is_main:
        if not written:
            log.warning("the outputs hook of '%s' wrote no image", cfg.experiment)
        for path in written:
            print(path, flush=True)
    return 0
