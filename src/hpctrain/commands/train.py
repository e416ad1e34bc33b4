"""`hpctrain train` and `hpctrain eval`: their arguments, their requests and their runs. Each resolves its config
(resolution.py), checks it for the world size, then starts torchrun's workers here or trains (evaluates) in this
process: cli -> here -> launcher.torchrun.launch_local | train.run."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Sequence

from hpctrain.commands.arguments import (add_launch_args, add_run_args, add_script_args, check_nproc,
                                         parse_with_overrides)
from hpctrain.config import batch_sizes, config_to_toml
from hpctrain.config.schema import RunConfig
from hpctrain.errors import UserError
from hpctrain.fault.alerts import resolve_webhook
from hpctrain.train.rundir import ensure_writable

if TYPE_CHECKING:  # torch: `hpctrain --help` builds every command's parser without it
    from hpctrain.dist.runtime import Runtime
    from hpctrain.experiments import Experiment

# What a worker imports before its first step (the training loop; DCP and through it DTensor and SymPy): imported
# once in the launcher when the workers are its forks (launcher/forked_workers).
PRELOAD = ("torch.distributed.checkpoint", "hpctrain.train.run", "hpctrain.userloop.step_runner")


def add_parser(sub) -> None:
    train = sub.add_parser(
        "train", help="train an experiment (locally, or inside torchrun/srun), or run your own torchrun script",
        description="hpctrain train EXPERIMENT [--nproc-per-node N] [--config F] [key=value ...], or "
        "hpctrain train --script PATH | --module MODULE [--nproc-per-node N] [--config F] [key=value ...] "
        "[-- SCRIPT ARGS ...]: torchrun here over the script (docs/scripts.md).")
    add_run_args(train, optional=True)
    add_launch_args(train)
    add_script_args(train, nproc=False)
    train.set_defaults(run=run, command_name="train")

    evaluate = sub.add_parser(
        "eval", help="validate a run's checkpoint (its latest, or --resume PATH) with the run's own config; prints JSON",
        description="hpctrain eval EXPERIMENT [run.dir=RUN_DIR] [--resume PATH] [--nproc-per-node N] [key=value ...]: "
        "reads RUN_DIR/config.toml (run.dir defaults to runs/EXPERIMENT) unless --config is given; key=value on top.")
    add_run_args(evaluate)
    add_launch_args(evaluate)
    evaluate.set_defaults(run=run_eval, command_name="eval")


@dataclass(frozen=True)
class ExperimentRequest:
    """An experiment's config sources and how many local processes to start (train and eval)."""

    experiment: str
    """Experiment name or module:Class."""
    config_file: str | None
    """--config FILE."""
    overrides: tuple[str, ...]
    """key=value items (--resume as ckpt.resume=...)."""
    nproc_per_node: int
    """--nproc-per-node; 0 when not given."""
    debug: bool
    """--debug."""
    command: ClassVar[str]
    """The command's name in a worker's command line."""

    @classmethod
    def from_args(cls, args: argparse.Namespace):
        overrides = tuple(args.overrides) + ((f"ckpt.resume={args.resume}",) if args.resume else ())
        return cls(args.experiment, args.config_file, overrides, check_nproc(args.nproc_per_node), args.debug)

    def module_args(self) -> list[str]:
        """The same request for the workers that torchrun starts (without --nproc-per-node)."""
        args = [self.command, self.experiment]
        args += ["--config", str(Path(self.config_file).resolve())] if self.config_file else []
        return args + list(self.overrides) + (["--debug"] if self.debug else [])


@dataclass(frozen=True)
class TrainRequest(ExperimentRequest):
    """`hpctrain train EXPERIMENT ...`."""

    command = "train"

    def resolve(self) -> tuple[type[Experiment], RunConfig]:
        from hpctrain.resolution import resolve_config

        return resolve_config(self.experiment, self.config_file, self.overrides)


@dataclass(frozen=True)
class EvalRequest(ExperimentRequest):
    """`hpctrain eval EXPERIMENT ...`: the run dir's own config unless --config is given."""

    command = "eval"

    def resolve(self) -> tuple[type[Experiment], RunConfig]:
        from hpctrain.resolution import resolve_eval

        return resolve_eval(self.experiment, self.config_file, self.overrides)


def run(args: argparse.Namespace) -> int:
    from hpctrain.commands.scripts import script_request, train_script

    script = script_request(args)
    if script is not None:
        if args.resume:
            raise UserError("--resume is hpctrain's own checkpoints' option; a script resumes from its own",
                            "drop --resume; pass your script its own resume option after --.")
        return train_script(script)
    return train(TrainRequest.from_args(args))


def run_eval(args: argparse.Namespace) -> int:
    return evaluate(EvalRequest.from_args(args))


def train(req: TrainRequest) -> int:
    from hpctrain.commands.launching import run_on_processes

    return run_on_processes(req, req.resolve, preflight, _train_here, alert=True, preload=PRELOAD)


def evaluate(req: EvalRequest) -> int:
    from hpctrain.commands.launching import run_on_processes

    return run_on_processes(req, req.resolve, preflight_read, _evaluate_here, alert=True, preload=PRELOAD)


def preflight(cfg: RunConfig, world_size: int) -> None:
    """What can be known wrong in a training before any process starts: batch arithmetic, run dir, checkpoint."""
    batch_sizes(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
    ensure_writable(Path(cfg.run_dir))
    from hpctrain.metrics.trackers.build import check_installed
    from hpctrain.train.resume_check import check_resume

    resolve_webhook(cfg.alert)  # an unreadable alert.webhook_file is bad input, found before training
    check_installed(cfg.log.trackers)  # a tracker without its package: the extra to install, before any process
    check_resume(cfg)


def preflight_read(cfg: RunConfig, world_size: int) -> None:
    """The same for a command that reads a checkpoint (eval, sample): the alert's webhook, the checkpoint named."""
    from hpctrain.train.resume_check import chosen_checkpoint

    resolve_webhook(cfg.alert)
    chosen_checkpoint(cfg)


def _train_here(cls: type[Experiment], cfg: RunConfig, runtime: Runtime) -> int:
    from hpctrain.experiments.step_experiment import is_step_experiment

    # The config text is the user's (train.channels_last=auto stays auto, resolved again on each launch).
    if is_step_experiment(cls):  # the experiment writes its own step: hpctrain's loop around it
        from hpctrain.userloop.step_runner import run_step_experiment

        return run_step_experiment(cfg, runtime, cls, config_to_toml(cfg))
    from hpctrain.train.run import run_training

    return run_training(cfg, runtime, cls, config_to_toml(cfg)).exit_code


def _evaluate_here(cls: type[Experiment], cfg: RunConfig, runtime: Runtime) -> int:
    from hpctrain.train.checkpoint_eval import run_evaluation

    run_evaluation(cfg, runtime, cls, config_to_toml(cfg))
    return 0


def config_from_argv(argv: Sequence[str]) -> RunConfig:
    """The config of a `hpctrain train|eval|sample ...` worker command line (for the launcher's failure alert when
    it runs as `python -m hpctrain.launch`); raises on anything unreadable, and on sample's (sampling is no run's
    training: no alert)."""
    requests = {"train": TrainRequest, "eval": EvalRequest}
    if not argv or argv[0] not in requests:
        raise ValueError(f"not a train or eval command line: {' '.join(argv)}")
    parser = argparse.ArgumentParser(prog="hpctrain")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return requests[argv[0]].from_args(parse_with_overrides(parser, argv)).resolve()[1]
