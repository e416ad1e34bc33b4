"""The demo: a MiniResNet on scikit-learn's bundled handwritten digits (no download)."""

from hpctrain.experiments.digits.experiment import DigitsExperiment, DigitsOptions

__all__ = ["DigitsExperiment", "DigitsOptions"]
