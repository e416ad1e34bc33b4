"""Experiments: the protocol, the registry, and the built-in experiments."""

from hpctrain.experiments.base import BatchInfo, Datasets, Experiment
from hpctrain.experiments.registry import list_experiments, resolve_experiment

__all__ = ["BatchInfo", "Datasets", "Experiment", "list_experiments", "resolve_experiment"]
