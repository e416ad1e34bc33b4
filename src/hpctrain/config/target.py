"""A script job's target: the user's own torchrun script (a path) or module (python -m), named in a RunConfig's
``experiment`` with one marker, ``script:``.

``experiment = "script:train.py"`` runs ``python train.py`` (the path as given, relative to the folder the job runs
in); ``experiment = "script:-m pkg.train"`` runs ``python -m pkg.train``. What follows the marker is what follows
``python`` on a command line, so the two forms cannot be confused, and neither with a ``module:Class`` experiment
(no class is named ``train.py`` or ``-m pkg.train``). The marker wins over a module named ``script``: such a module
cannot hold an experiment named ``script:Class``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath

SCRIPT_PREFIX = "script:"
"""The marker a script job's experiment starts with."""
MODULE_FLAG = "-m "
"""After the marker: a module run as python -m MODULE, not a path."""
_MODULE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


@dataclass(frozen=True, kw_only=True)
class ScriptTarget:
    """What a script job's workers run: exactly one of a path and a module."""

    path: str = ""
    """The script's path as the user gave it ('' for a module)."""
    module: str = ""
    """The module of python -m MODULE ('' for a path)."""

    @classmethod
    def parse(cls, experiment: str) -> "ScriptTarget | None":
        """The target a ``script:`` experiment names; None for any other experiment."""
        if not experiment.startswith(SCRIPT_PREFIX):
            return None
        rest = experiment[len(SCRIPT_PREFIX):]
        if rest.startswith(MODULE_FLAG):
            return cls(module=rest[len(MODULE_FLAG):].strip())
        return cls(path=rest)

    @property
    def experiment(self) -> str:
        """The config's experiment value for this target."""
        return SCRIPT_PREFIX + (MODULE_FLAG + self.module if self.module else self.path)

    @property
    def python_args(self) -> list[str]:
        """What follows ``python`` (and torchrun) to run it: [PATH] or [-m, MODULE]."""
        return ["-m", self.module] if self.module else [self.path]

    @property
    def shown(self) -> str:
        """How messages name it: the path, or '-m MODULE'."""
        return f"-m {self.module}" if self.module else self.path

    @property
    def run_name(self) -> str:
        """The default run name and run dir's last part: the script's file stem (train.py: train), or the module's
        last part (pkg.train: train)."""
        name = self.module.rsplit(".", 1)[-1] if self.module else PurePath(self.path).stem
        return name or "script"

    def problem(self) -> str:
        """What is wrong with the target as written ('' when nothing): an empty path, a module name that Python
        cannot import."""
        if self.module:
            return "" if _MODULE.match(self.module) else f"'{self.module}' is not a Python module name"
        return "" if self.path.strip() else "no script path given"


def is_script(experiment: str) -> bool:
    """Whether a config's experiment names a script job (``script:...``)."""
    return experiment.startswith(SCRIPT_PREFIX)


def same_training(saved: str, experiment: str) -> bool:
    """Whether a checkpoint saved for experiment ``saved`` belongs to ``experiment``: the same name, or for a script
    the same script however its path was written (``train.py``, ``./jobs/train.py`` and ``-m jobs.train`` name one
    script, by its run name), so that the same loop resumes under torchrun, hpctrain train and Slurm alike."""
    if saved == experiment:
        return True
    a, b = ScriptTarget.parse(saved), ScriptTarget.parse(experiment)
    return a is not None and b is not None and a.run_name == b.run_name
