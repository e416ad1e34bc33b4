"""The program every rendered job script runs: ``python -m hpctrain.launch [torchrun's arguments] -m MODULE ARGS``.

torchrun in this process with hpctrain's handling (hpctrain.launcher.torchrun). This entry point adds what the
launcher, below the commands and the training, cannot know: when the workers run hpctrain, the modules they import
(imported once here before they are forked) and the run's config, read from their command line for the failure
report and alert; for a script job (--script), the job's settings and the batch shell's word. Job scripts already
rendered into run dirs call this path (a requeued job re-runs its old script), as do those of earlier versions
through hpctrain.dist.torchrun_main: keep it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from hpctrain.dist.env import script_settings_path, script_step
from hpctrain.launcher import torchrun
from hpctrain.launcher.arguments import worker_module


def main(argv: Sequence[str] | None = None) -> int:
    """torchrun with ``argv`` (None: sys.argv's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if _script_job_settings():  # a script job's node launcher (its job script exported the settings)
        return _script_job(argv)
    module, args = worker_module(argv) or ("", [])
    if module != "hpctrain":
        return torchrun.main(argv)
    from hpctrain.commands.train import PRELOAD, config_from_argv

    return torchrun.main(argv, preload=PRELOAD, read_config=lambda: config_from_argv(args))


def _script_job_settings() -> str:
    """HPCTRAIN_SETTINGS where it names a script job's settings ('' otherwise: an experiment's job launched from a
    shell that happens to have it set stays an experiment's). The script's own arguments are not looked at: they
    may hold anything, '-m hpctrain' too."""
    settings = script_settings_path()
    if not settings:
        return ""
    from hpctrain.config.target import is_script
    from hpctrain.errors import UserError
    from hpctrain.resolution import run_experiment_name

    try:
        return settings if is_script(run_experiment_name(Path(settings))) else ""
    except UserError as err:  # torchrun runs the program as it is, without the job's records (no requeue)
        print(f"hpctrain: HPCTRAIN_SETTINGS is set but unreadable, so this is no script job's launch: {err}",
              file=sys.stderr)
        return ""


def _script_job(argv: list[str]) -> int:
    """torchrun over the user's script, with the job's settings (HPCTRAIN_SETTINGS: its requeue codes, the alert)
    and the batch shell's word (where to record the node's outcome, whether to pass signals on)."""
    from hpctrain.errors import UserError
    from hpctrain.resolution import resolve_script, run_experiment_name

    settings = script_settings_path()
    try:
        cfg = resolve_script(run_experiment_name(Path(settings)), settings)
    except UserError as err:
        print(f"hpctrain: error: {err}", file=sys.stderr)
        return 2
    return torchrun.main(argv, cfg, script=torchrun.ScriptLaunch(codes=cfg.fault.requeue_codes, step=script_step()))


if __name__ == "__main__":
    from hpctrain.process_exit import run_and_exit

    run_and_exit(main)  # no interpreter finalization, where torch's threads can abort the process
