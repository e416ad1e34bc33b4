"""A loop you write, with what hpctrain owns: ``with hpctrain.session() as run:``.

The session is the process's training: it reads the launch (torchrun, srun or one plain process), resolves the
settings (hpctrain's defaults < the script's ``defaults`` < ``config`` < ``overrides`` < what `hpctrain train|slurm
submit --script` was given), joins the process group, locks the run dir, installs the stop signals, starts the
heartbeat, and hands out ``run`` (userloop/core.py TrainingSession): wrap, register, steps, evaluate, poll, agree,
phase. When the ranks agreed to stop, the loop saves and the process exits there: fault.exit_code (75: resume
me; requeued under Slurm) or 130 after Ctrl-C. Bad use is a message and exit code 2, as on hpctrain's command line.

>>> import hpctrain
>>> callable(hpctrain.session)
True
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from hpctrain.config.load import config_to_toml, load_config
from hpctrain.config.schema import NoModelOptions, RunConfig
from hpctrain.config.target import SCRIPT_PREFIX
from hpctrain.errors import UserError
from hpctrain.userloop.core import Steps, TrainingSession
from hpctrain.userloop.step import Step

__all__ = ["session", "Step", "Steps", "TrainingSession", "resolve_session_config"]

_ACTIVE: list[TrainingSession] = []
"""The session of this process while it runs: a second one inside it is refused."""


def resolve_session_config(defaults: Mapping[str, Any] | None = None, config: str | Path | None = None,
                           overrides: Sequence[str] = (), options: type = NoModelOptions,
                           name: str | None = None) -> RunConfig:
    """The session's settings. Its experiment is ``script:PROGRAM`` (the run dir runs/PROGRAM unless run.dir
    says otherwise), or the one of the settings file hpctrain gave the script."""
    from hpctrain.dist.env import script_name, session_settings

    settings = session_settings() or None
    experiment = _settings_experiment(settings) if settings else None
    experiment = experiment or (f"{SCRIPT_PREFIX}{name}" if name else f"{SCRIPT_PREFIX}{script_name()}")
    return load_config(experiment, options, experiment_defaults=defaults, config_file=config,
                       overrides=tuple(overrides), launch_settings=settings)


def _settings_experiment(path: str) -> str | None:
    import tomllib

    try:
        value = tomllib.loads(Path(path).read_text(encoding="utf-8")).get("experiment")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise UserError(f"cannot read the settings hpctrain gave this script ({path}): {err}",
                        "start the script again through hpctrain, or unset HPCTRAIN_SETTINGS to run it on its own.") \
            from None
    return value if isinstance(value, str) and value else None


@contextlib.contextmanager
def session(defaults: Mapping[str, Any] | None = None, *, config: str | Path | None = None,
            overrides: Sequence[str] = (), options: type = NoModelOptions,
            name: str | None = None) -> Iterator[TrainingSession]:
    """The training session of this process: ``defaults`` (dotted keys, like an Experiment's), a TOML ``config``
    file and ``key=value`` ``overrides`` of the script's own; ``options``: a frozen dataclass for the [model] section;
    ``name``: the run's name in its checkpoints (default: the script's file name)."""
    from hpctrain.errors import agreed
    from hpctrain.process_exit import exit_code_of, exit_without_finalizing

    if _ACTIVE:
        print("hpctrain: error: hpctrain.session() inside another session\nHINT: one session per process: use the "
              "run it gave.", file=sys.stderr)
        exit_without_finalizing(2)
    interrupted = exiting = False
    try:
        with _session(defaults, config, overrides, options, name) as run:
            yield run
        code = run.exit_code
    except UserError as err:
        rank = _rank()
        if not (rank and agreed(err)):  # a verdict the ranks reached together is rank 0's to print
            print(f"hpctrain: error: {f'[rank {rank}] ' if rank else ''}{err}", file=sys.stderr)
        code = 2
    except SystemExit as exc:  # sys.exit() in the loop ends the process, as it would without the session
        code, exiting = exit_code_of(exc), True
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 130, True
    except BaseException:  # noqa: BLE001 - the user's error, reported as Python would, then the process ends
        sys.excepthook(*sys.exc_info())
        code = 1
    if code or exiting:
        # A stop, misuse or failure is the end of the process, as hpctrain train's: no interpreter teardown in
        # which torch's threads (a rank that failed alone, its peers still in a collective) can abort or hang it.
        exit_without_finalizing(code, by_sigint=interrupted)


@contextlib.contextmanager
def _session(defaults, config, overrides, options, name) -> Iterator[TrainingSession]:
    from hpctrain.dist.env import detect_launch
    from hpctrain.dist.runtime import distributed_session
    from hpctrain.fault.run_lock import hold_run_dir
    from hpctrain.logs import setup_logging
    from hpctrain.train.compile_cache import node_copy_removed

    launch = detect_launch()
    setup_logging(launch.rank, launch.world_size, launch.hostname)
    cfg = resolve_session_config(defaults, config, overrides, options, name)
    _preflight(cfg, launch.world_size)
    with distributed_session(launch, cfg.dist) as runtime, \
            hold_run_dir(Path(cfg.run_dir), runtime) as lock, \
            node_copy_removed(Path(cfg.run_dir), runtime.device, runtime.local_rank, cfg.train.compiled):
        run = TrainingSession(cfg, runtime, config_to_toml(cfg), lock=lock)
        _ACTIVE.append(run)
        try:
            with run.opened():
                yield run
        finally:
            _ACTIVE.remove(run)


def _preflight(cfg: RunConfig, world_size: int) -> None:
    """What hpctrain train checks before any process starts, here on every rank (the same verdict everywhere)."""
    from hpctrain.config.batch import batch_sizes
    from hpctrain.fault.alerts import resolve_webhook
    from hpctrain.train.resume_check import check_resume
    from hpctrain.train.rundir import ensure_writable

    batch_sizes(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
    ensure_writable(Path(cfg.run_dir))
    resolve_webhook(cfg.alert)
    check_resume(cfg)


def _rank() -> int:
    from hpctrain.dist.env import detect_launch

    try:
        return detect_launch().rank
    except UserError:
        return 0
