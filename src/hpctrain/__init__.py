"""hpctrain: take a PyTorch training job from one process to many GPUs on many nodes.

The public API, imported on first use (``import hpctrain`` and ``hpctrain --version`` stay light):
``Experiment`` (subclass it: the protocol of an experiment), ``BatchInfo``, ``Datasets`` and ``Outputs`` (what its
hooks receive and return), ``StepExperiment`` (an experiment that writes its own step: several models and
optimizers), ``session`` (a loop you write: ``with hpctrain.session() as run``) and the ``Step`` both hand out,
``resolve_config`` (an experiment name, a TOML file and key=value overrides into the class and its config) and
``__version__``.

>>> from hpctrain import resolve_config
>>> cls, cfg = resolve_config("digits", overrides=["train.max_steps=4"])
>>> cls.name, cfg.train.max_steps
('digits', 4)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "Experiment": "hpctrain.experiments.base",
    "BatchInfo": "hpctrain.experiments.base",
    "Datasets": "hpctrain.experiments.base",
    "Outputs": "hpctrain.experiments.outputs",
    "StepExperiment": "hpctrain.experiments.step_experiment",
    "session": "hpctrain.userloop",
    "Step": "hpctrain.userloop.step",
    "resolve_config": "hpctrain.resolution",
}
"""Each public name and the module that defines it."""

__all__ = ["__version__", *_PUBLIC]

if TYPE_CHECKING:
    from hpctrain.experiments.base import BatchInfo, Datasets, Experiment
    from hpctrain.experiments.outputs import Outputs
    from hpctrain.experiments.step_experiment import StepExperiment
    from hpctrain.resolution import resolve_config
    from hpctrain.userloop import session
    from hpctrain.userloop.step import Step


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hpctrain' has no attribute '{name}'")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
