"""hpctrain: take a PyTorch training job from one process to many GPUs on many nodes."""

__version__ = "0.1.0"
