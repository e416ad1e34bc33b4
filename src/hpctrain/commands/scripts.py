"""What the commands share for a script job (--script PATH or --module MODULE, its arguments after --): the target
and its config from the command line, the settings the user gave (RUN_DIR/settings.toml, HPCTRAIN_SETTINGS), the
run dir's files, and `hpctrain train --script` on this machine (torchrun here, launcher.torchrun.launch_script)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from hpctrain.atomic import atomic_write_text
from hpctrain.commands.arguments import check_nproc
from hpctrain.config.load import given_keys, settings_toml
from hpctrain.config.schema import RunConfig
from hpctrain.config.target import ScriptTarget, is_script
from hpctrain.errors import UserError

log = logging.getLogger("hpctrain")

SETTINGS_FILE = "settings.toml"
"""RUN_DIR/settings.toml: the settings a script job's processes find in HPCTRAIN_SETTINGS."""
PROCESSES_KEY = "slurm.gpus_per_node"
"""What --nproc-per-node sets for a job on Slurm when the user did not set it: processes (GPUs) per node."""


@dataclass(frozen=True, kw_only=True)
class ScriptRequest:
    """A command line that names a script of the user's: what to run and with which settings."""

    target: ScriptTarget
    """The script (a path as given) or module."""
    config_file: str | None = None
    """--config FILE."""
    overrides: tuple[str, ...] = ()
    """hpctrain's key=value settings (before --)."""
    script_args: tuple[str, ...] = ()
    """Everything after --, passed to the script verbatim."""
    nproc_per_node: int = 0
    """--nproc-per-node; 0 when not given."""
    debug: bool = False
    """--debug."""

    @property
    def experiment(self) -> str:
        return self.target.experiment

    def job_overrides(self) -> tuple[str, ...]:
        """The overrides of a job on Slurm (with_processes)."""
        return with_processes(self.experiment, self.config_file, self.overrides, self.nproc_per_node)

    def resolve(self, job: bool = False) -> RunConfig:
        """The script job's config (``job``: with job_overrides, for Slurm)."""
        from hpctrain.resolution import resolve_script

        return resolve_script(self.experiment, self.config_file, self.job_overrides() if job else self.overrides)

    def settings(self, cfg: RunConfig, job: bool = False) -> str:
        """RUN_DIR/settings.toml's text: the settings the user gave, resolved (config/load.settings_toml)."""
        overrides = self.job_overrides() if job else self.overrides
        return settings_toml(cfg, given_keys(self.experiment, self.config_file, overrides))


def with_processes(experiment: str, config_file: str | None, overrides: tuple[str, ...],
                   nproc_per_node: int) -> tuple[str, ...]:
    """A job's overrides on Slurm: --nproc-per-node N sets slurm.gpus_per_node=N where neither the file nor the
    command line set it (one process per GPU); where they did, the lint compares the two."""
    if not nproc_per_node or PROCESSES_KEY in given_keys(experiment, config_file, overrides):
        return overrides
    return (*overrides, f"{PROCESSES_KEY}={nproc_per_node}")


def script_request(args: argparse.Namespace) -> ScriptRequest | None:
    """The script a command line names (--script, --module, or a positional EXPERIMENT that ends in .py and names
    a file), or None for an experiment. Contradictions are refused with what to do."""
    positional = getattr(args, "experiment", "") or ""
    overrides = tuple(getattr(args, "overrides", ()))
    if "=" in positional:  # with --script, argparse gives the first key=value to the optional EXPERIMENT
        positional, overrides = "", (positional, *overrides)
    path, module = getattr(args, "script", None), getattr(args, "module", None)
    if path is not None or module is not None:
        if positional:
            flag = "--script" if path is not None else "--module"
            raise UserError(f"{flag} runs your own script, and '{positional}' names an experiment as well: give one "
                            "of them", f"drop '{positional}' to run the script, or {flag} to train the experiment.")
        target = ScriptTarget(path=path) if path is not None else ScriptTarget(module=module)
    elif is_script(positional):
        target = ScriptTarget.parse(positional)
    elif positional.endswith(".py"):
        if not Path(positional).is_file():
            raise UserError(f"there is no script '{positional}' (an EXPERIMENT that ends in .py names a script)",
                            "check the path (relative to this folder); for an experiment give its name or "
                            "package.module:Class ('hpctrain experiments' lists the built-in ones).")
        target = ScriptTarget(path=positional)
    else:
        if getattr(args, "script_args", None):
            raise UserError(f"arguments after -- go to a script, and '{positional or '(none)'}' is an experiment",
                            "give --script PATH (or --module MODULE) to run a script of your own, or drop the "
                            "arguments after --.")
        if not positional:
            raise UserError("no experiment and no script given",
                            "name an experiment (e.g. digits; 'hpctrain experiments' lists them), or your own "
                            "torchrun script with --script PATH (or --module MODULE), its arguments after --.")
        return None
    if target.problem():
        raise UserError(f"cannot run the script: {target.problem()}",
                        "give --script PATH (a file) or --module MODULE (as python -m takes it).")
    return ScriptRequest(target=target, config_file=getattr(args, "config_file", None), overrides=overrides,
                         script_args=tuple(getattr(args, "script_args", None) or ()),
                         nproc_per_node=check_nproc(getattr(args, "nproc_per_node", 0) or 0),
                         debug=getattr(args, "debug", False))


def require_script_file(target: ScriptTarget, workdir: Path | None = None) -> None:
    """A UserError when the script cannot be run from here (missing, a folder, unreadable): before a local launch,
    where nothing should start for a typo."""
    from hpctrain.slurm.facts import file_problem

    if target.module:
        return
    path = (workdir or Path.cwd()) / target.path
    problem = file_problem(path)
    if problem == "missing":
        raise UserError(f"script {path} does not exist", "check the path given to --script (relative to this folder).")
    if problem == "directory":
        raise UserError(f"{path} is a directory, not a script", "name the .py file that torchrun should run.")
    if problem:
        raise UserError(f"script {path} cannot be read: {problem}", "check its permissions.")


def write_run_files(cfg: RunConfig, settings: str) -> Path:
    """RUN_DIR/config.toml (the resolved config: status and report read it; an earlier, different one kept beside
    it) and RUN_DIR/settings.toml (what the script's processes read), each written whole; returns the settings
    file's absolute path."""
    from hpctrain.config.load import config_to_toml
    from hpctrain.train.rundir import ensure_writable, write_config

    run_dir = Path(cfg.run_dir)
    ensure_writable(run_dir)
    write_config(run_dir, config_to_toml(cfg))
    path = (run_dir / SETTINGS_FILE).resolve()
    atomic_write_text(path, settings)
    return path


def train_script(req: ScriptRequest) -> int:
    """`hpctrain train --script PATH [--nproc-per-node N] [key=value ...] -- ARGS`: torchrun here, N processes
    (1 without the flag) over the script, each with HPCTRAIN_SETTINGS; exits as the workers did (fault.exit_code:
    the script asked to be resumed)."""
    from hpctrain.dist.env import detect_launch, script_environment
    from hpctrain.logs import setup_logging

    if detect_launch().launcher != "single":
        raise UserError("hpctrain train --script starts torchrun itself, and this process already is a rank of "
                        "torchrun or srun", "run it from a plain shell, or run your script directly under your "
                        "launcher.")
    cfg = req.resolve()
    require_script_file(req.target)
    setup_logging(debug=req.debug)
    settings = write_run_files(cfg, req.settings(cfg))
    nproc = req.nproc_per_node or 1
    log.info("starting %d process(es) with torchrun: %s; run dir %s", nproc, req.target.shown, cfg.run_dir)
    from hpctrain.launcher.torchrun import launch_script

    with script_environment(str(settings)):
        return launch_script(nproc, [*req.target.python_args, *req.script_args], cfg)
