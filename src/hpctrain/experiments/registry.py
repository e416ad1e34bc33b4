"""Experiments by name, or any user class by 'package.module:Class'.

Built-ins are import paths, not imports, so naming one experiment never imports the
others' dependencies.
"""

from __future__ import annotations

import importlib
import os
import sys

from hpctrain.config.target import ScriptTarget
from hpctrain.errors import UserError, did_you_mean
from hpctrain.experiments.base import Experiment

BUILTIN: dict[str, str] = {
    "digits": "hpctrain.experiments.digits:DigitsExperiment",
    "ddpm_cifar10": "hpctrain.experiments.ddpm.experiment:DDPMCifar10",
    "ddpm_digits": "hpctrain.experiments.ddpm.experiment:DDPMDigits",
    "faceseg": "hpctrain.experiments.faceseg.experiment:FaceSegGenerated",
    "faceseg_celebamask": "hpctrain.experiments.faceseg.experiment:FaceSegCelebAMask",
}


def list_experiments() -> list[str]:
    return sorted(BUILTIN)


def resolve_experiment(name: str) -> type[Experiment]:
    script = ScriptTarget.parse(name)
    if script is not None:
        raise UserError(
            f"'{name}' is a script run by torchrun ({script.shown}), not an hpctrain experiment: hpctrain does not "
            "know its model, data or checkpoints, so it cannot evaluate, export, sample or predict from its run",
            "use your script's own evaluation; for a script's run dir hpctrain offers 'hpctrain report RUN_DIR' and "
            "'hpctrain slurm status|logs RUN_DIR'.",
        )
    target = BUILTIN.get(name, name)
    if ":" not in target:
        path = ""
        if "/" in name or name.endswith(".py"):
            path = (f" '{name}' is a file here: --script {name} runs it as a script." if os.path.isfile(name)
                    else " It looks like a path, but no such file is here.")
        raise UserError(
            f"unknown experiment '{name}'.{did_you_mean(name, BUILTIN)}{path}",
            f"built-in experiments: {', '.join(list_experiments())}; or give your own as 'package.module:Class'; "
            "to run a torchrun script of your own: --script PATH (or --module MODULE).",
        )
    module_name, _, attr = target.partition(":")
    # Like uvicorn and gunicorn: the user's module in the working directory is importable from the
    # console script too, not only under `python -m hpctrain` (which puts the cwd on sys.path itself).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise UserError(
                f"cannot import module '{module_name}' for experiment '{name}'",
                "check the spelling, and that the module is on PYTHONPATH or installed.",
            ) from None
        raise UserError(
            f"experiment '{name}' needs the package '{err.name}', which is not installed",
            f"install it (e.g. pip install {err.name}).",
        ) from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise UserError(f"module '{module_name}' has no attribute '{attr}'", "check the name after the ':'.")
    if not (isinstance(cls, type) and issubclass(cls, Experiment)):
        raise UserError(
            f"'{target}' is not an hpctrain Experiment subclass",
            "subclass hpctrain.experiments.Experiment and implement build_model, build_datasets, train_loss.",
        )
    return cls
