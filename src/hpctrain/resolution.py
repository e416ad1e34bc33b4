"""Config resolution: an experiment name (or package.module:Class), a TOML file and key=value overrides into the
experiment's class and its frozen RunConfig; and a trained run dir's own config (its config.toml, overrides on
top), as eval, sample, export and predict read it.

Public (`from hpctrain import resolve_config`): every part below the commands resolves through here, so a config
means the same to `hpctrain train`, `slurm submit`, `sweep` and `plan`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Sequence

from hpctrain.checkpoint.policy import select_checkpoint
from hpctrain.config.load import load_config
from hpctrain.config.schema import NoModelOptions, RunConfig
from hpctrain.config.target import ScriptTarget, is_script
from hpctrain.errors import UserError
from hpctrain.experiments import Experiment, resolve_experiment

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SAMPLING_KEYS = {"model.samples": "--n", "model.sample_steps": "--ddim-steps"}
"""Options `hpctrain sample` sets, and the flags that set them."""


def resolve_config(experiment: str, config_file: str | None = None,
                   overrides: Sequence[str] = ()) -> tuple[type[Experiment], RunConfig]:
    """The experiment's class and its config: the class's defaults, then ``config_file``, then ``overrides``."""
    cls = resolve_experiment(experiment)
    cfg = load_config(experiment, cls.config_class, experiment_defaults=cls.defaults, config_file=config_file,
                      overrides=tuple(overrides))
    return cls, cfg


def resolve_script(experiment: str, config_file: str | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """A script job's config (experiment 'script:PATH' or 'script:-m MODULE'): hpctrain's defaults, then
    ``config_file``, then ``overrides``; no experiment class, an empty [model] section. The settings that cannot
    work for a script (its target malformed, slurm.launcher=srun) are refused here."""
    target = ScriptTarget.parse(experiment)
    if target is None:
        raise ValueError(f"not a script job's experiment: {experiment!r}")
    if target.problem():
        raise UserError(f"cannot run the script: {target.problem()}",
                        "give --script PATH (a file) or --module MODULE (as for python -m).")
    cfg = load_config(experiment, NoModelOptions, config_file=config_file, overrides=tuple(overrides))
    if cfg.slurm.launcher == "srun":
        raise UserError("slurm.launcher=srun does not run a script: a script job runs torchrun on every node, which "
                        "sets the variables a torchrun script reads (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...)",
                        "leave slurm.launcher at torchrun for --script and --module jobs.")
    return cfg


def resolve_settings(experiment: str, config_file: str | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The config of an experiment (resolve_config's) or of a script job (resolve_script's), for what needs the
    settings alone: the job script, its lint, a sweep's points."""
    if is_script(experiment):
        return resolve_script(experiment, config_file, overrides)
    return resolve_config(experiment, config_file, overrides)[1]


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


def resolve_run(run_dir: Path, overrides: Sequence[str] = ()) -> tuple[type[Experiment], RunConfig]:
    """A run dir's experiment and config (its config.toml, the overrides on top; run.dir is RUN_DIR and
    ckpt.resume defaults to auto, whatever the run was started with)."""
    config_path = run_config_path(run_dir)
    name = run_experiment_name(config_path)
    cls = resolve_experiment(name)
    cfg = load_config(name, cls.config_class, experiment_defaults=cls.defaults, config_file=config_path,
                      overrides=("ckpt.resume=auto", *overrides, f"run.dir={run_dir}"))
    return cls, cfg


def resolve_eval(experiment: str, config_file: str | None,
                 overrides: Sequence[str]) -> tuple[type[Experiment], RunConfig]:
    """`hpctrain eval`'s config: the run's own settings (its [model] keys above all: a run trained with other ones
    would not load) and its own latest checkpoint, with the command line's on top, as sample, export and report
    read a run dir; without a config.toml in run.dir, or with --config, the experiment's as for training."""
    cls, cfg = resolve_config(experiment, config_file, overrides)
    if not config_file and (Path(cfg.run_dir) / "config.toml").is_file():
        return resolve_run(Path(cfg.run_dir), overrides)
    return cls, cfg


def check_can_sample(cls: type[Experiment], overrides: Sequence[str]) -> None:
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


def resolve_sample(run_dir: Path, overrides: Sequence[str]) -> tuple[type[Experiment], RunConfig]:
    """resolve_run, after checking that the run's experiment can be sampled as asked and has a checkpoint."""
    cls = resolve_experiment(run_experiment_name(run_config_path(run_dir)))
    check_can_sample(cls, overrides)
    cls, cfg = resolve_run(run_dir, overrides)
    # Cheap (no checksums), before any process starts: a run dir without a checkpoint has no weights to draw with.
    chosen, _ = select_checkpoint(run_dir / "checkpoints", cfg.ckpt.resume, cfg.experiment, verify_checksums=False)
    if chosen is None:
        raise UserError(f"no checkpoint in '{run_dir / 'checkpoints'}'",
                        "train first, or point --resume at a checkpoint directory.")
    return cls, cfg


def resolve_weights(run_dir: Path, resume: str) -> tuple[type[Experiment], RunConfig]:
    """A run dir's config for reading its shipped weights in one process (export, predict): ``resume`` is the
    checkpoint (auto or a path); never is refused, it would load none."""
    if resume == "never":
        raise UserError("--resume never loads no weights", "use --resume auto or a checkpoint directory.")
    return resolve_run(run_dir, (f"ckpt.resume={resume}",))
