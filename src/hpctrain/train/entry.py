"""`hpctrain train`: resolve the config, check it for this world size, then train here or launch torchrun."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from hpctrain.checkpoint.policy import select_checkpoint
from hpctrain.config import config_to_toml, load_config, batch_sizes
from hpctrain.config.schema import RunConfig
from hpctrain.dist.env import LaunchInfo, detect_launch
from hpctrain.dist.forked_workers import quiet_launcher
from hpctrain.dist.runtime import distributed_session
from hpctrain.experiments import Experiment, resolve_experiment
from hpctrain.fault.alerts import resolve_webhook
from hpctrain.fault.error_file import record_errors
from hpctrain.logs import setup_logging
from hpctrain.train.memory_format import MemoryFormat, resolve_memory_format
from hpctrain.train.rundir import ensure_writable, removed_if_left_empty
from hpctrain.train.resume_settings import refuse_fixed_changes
from hpctrain.train.state import continue_with_batch, read_state

log = logging.getLogger("hpctrain")


@dataclass(frozen=True)
class TrainRequest:
    experiment: str
    """Experiment name or module:Class."""
    config_file: str | None
    """--config FILE."""
    overrides: tuple[str, ...]
    """key=value items."""
    nproc_per_node: int
    """--nproc-per-node; 0 when not given."""
    debug: bool
    """--debug."""
    command: str = "train"
    """train, eval or sample (then ``experiment`` is the run directory)."""
    out: str = ""
    """sample: --out DIR ('' = RUN_DIR/samples)."""

    def module_args(self) -> list[str]:
        """The same request for the workers that torchrun starts (without --nproc-per-node)."""
        args = [self.command, self.experiment]
        if self.config_file:
            args += ["--config", str(Path(self.config_file).resolve())]
        args += list(self.overrides) + (["--out", str(Path(self.out).resolve())] if self.out else [])
        return args + (["--debug"] if self.debug else [])


def resolve(experiment: str, config_file: str | None, overrides: tuple[str, ...]) -> tuple[type[Experiment], RunConfig]:
    cls = resolve_experiment(experiment)
    cfg = load_config(
        experiment, cls.config_class, experiment_defaults=cls.defaults, config_file=config_file, overrides=overrides
    )
    return cls, cfg


def preflight(cfg: RunConfig, world_size: int, command: str = "train") -> None:
    """What can be known wrong before any process starts: batch arithmetic, run dir, checkpoint."""
    run_dir = Path(cfg.run_dir)
    if command == "train":
        batch_sizes(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
        ensure_writable(run_dir)
    resolve_webhook(cfg.alert)  # an unreadable alert.webhook_file is bad input, found before training
    check_resume(cfg, command)


def check_resume(cfg: RunConfig, command: str = "train") -> Path | None:
    """The checkpoint this launch would start from, against the config: the local launch checks it, and so does
    `hpctrain slurm submit` before sbatch (a refusal after the queue wait would come from every rank). Returns
    its path (None for a fresh start)."""
    # Cheap checks only (the workers verify checksums before loading).
    chosen, _ = select_checkpoint(Path(cfg.run_dir) / "checkpoints", cfg.ckpt.resume, cfg.experiment,
                                  verify_checksums=False)
    if command == "train" and chosen is not None:
        _check_saved_batch(chosen.path, cfg)
        refuse_fixed_changes(chosen.path, cfg)  # optim.name: the checkpoint's optimizer state belongs to it
    return chosen.path if chosen is not None else None


def _check_saved_batch(path: Path, cfg: RunConfig) -> None:
    """A changed train.global_batch_size stops here, before any process starts or anything is written.
    Warnings wait for the restore (rank 0), so they are said once."""
    saved = read_state(path)
    if saved is not None:
        continue_with_batch(saved, cfg.train.global_batch_size, cfg.ckpt.on_batch_change, str(path), total_steps=0)


def resolve_request(req: TrainRequest) -> tuple[type[Experiment], RunConfig]:
    if req.command == "sample":
        from hpctrain.train.sample import resolve_sample

        return resolve_sample(Path(req.experiment), req.overrides)
    cls, cfg = resolve(req.experiment, req.config_file, req.overrides)
    if req.command == "eval" and not req.config_file and (Path(cfg.run_dir) / "config.toml").is_file():
        # The run's own settings (its [model] keys above all: a run trained with other ones would not load) and its
        # own latest checkpoint, with the command line's on top: as sample, export and report read a run dir.
        from hpctrain.train.sample import resolve_run

        return resolve_run(Path(cfg.run_dir), req.overrides)
    return cls, cfg


def train_command(req: TrainRequest) -> int:
    launch = detect_launch()
    local = launch.launcher == "single" and req.nproc_per_node > 1
    # Before the experiment's module is imported: its module-level tensor ops must not start an OpenMP team that
    # the forked workers would inherit without its threads (dist/forked_workers).
    threads = quiet_launcher() if local else None
    cls, cfg = resolve_request(req)
    # The user's own command, not a rank that torchrun or srun started: a run dir it creates and leaves empty goes.
    with removed_if_left_empty(Path(cfg.run_dir)) if launch.launcher == "single" else contextlib.nullcontext():
        return _launch_local(cfg, req, threads) if local else _train_here(cls, cfg, launch, req)


def _launch_local(cfg: RunConfig, req: TrainRequest, threads) -> int:
    setup_logging(debug=req.debug)
    preflight(cfg, req.nproc_per_node, req.command)
    log.info("starting %d processes with torchrun", req.nproc_per_node)
    from hpctrain.launch import launch_local

    # The config makes the failure alert and the "resume me" exit; sample is not the run's training.
    return launch_local(req.nproc_per_node, req.module_args(), cfg if req.command in ("train", "eval") else None,
                        threads)


def unstaged(cfg: RunConfig) -> RunConfig:
    """The config without data.stage_dir: evaluation reads the validation set once, which a copy to every node
    (of the training split too: experiments build both) would only delay."""
    if cfg.data.stage_dir:
        log.info("hpctrain eval reads the shards where they are: data.stage_dir=%s is for training's epochs",
                 cfg.data.stage_dir)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, stage_dir=""))


# torchrun's error file, written atomically: the launcher's failure report and alert then carry this rank's error
@record_errors
def _train_here(cls: type[Experiment], cfg: RunConfig, launch: LaunchInfo, req: TrainRequest) -> int:
    setup_logging(launch.rank, launch.world_size, launch.hostname, req.debug)
    if req.nproc_per_node and launch.launcher != "single" and req.nproc_per_node != launch.local_world_size:
        log.warning(
            "--nproc-per-node=%d ignored: already launched by %s with %d processes on this node",
            req.nproc_per_node, launch.launcher, launch.local_world_size,
        )
    # Every rank checks (cheap, same verdict everywhere), so no rank waits in the rendezvous for a peer that quit.
    preflight(cfg, launch.world_size, req.command)
    from hpctrain.train.run import run_evaluation, run_training  # heavy imports only where work happens

    with distributed_session(launch, cfg.dist) as runtime:
        if req.command == "sample":  # sampling reads no layout (the outputs hook makes its own tensors)
            from hpctrain.train.sample import sample_here

            return sample_here(cfg, runtime, cls(cfg), req.out)
        # The config text is the user's (train.channels_last=auto stays auto, resolved again on each launch); the
        # experiment and the loop get the resolved one.
        text = config_to_toml(cfg)
        cfg, layout = launch_config(cls, cfg, runtime, req.command)
        if req.command == "eval":
            run_evaluation(cfg, runtime, cls(unstaged(cfg)), text)
            return 0
        return run_training(cfg, runtime, cls(cfg), text, layout.describe()).exit_code


def launch_config(cls: type[Experiment], cfg: RunConfig, runtime, command: str) -> tuple[RunConfig, MemoryFormat]:
    """The config with what depends on this launch's device resolved (train.channels_last, which follows the step
    mode: train/layout.py), and the layout chosen (training's start-up lines say it)."""
    from hpctrain.train.precision import resolve_precision
    from hpctrain.train.step import choose_step_mode

    experiment = cls(cfg)  # the layout does not change what it is built from
    mode = "eager"  # evaluation runs no optimizer step
    if command == "train":
        precision = resolve_precision(cfg.train.precision, runtime.device)
        mode = choose_step_mode(cfg, runtime, precision, experiment.graphable).mode
    return resolve_memory_format(cfg, runtime, experiment, mode)
