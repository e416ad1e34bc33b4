"""DDPM (reference experiment 1): the U-Net (model.py), the diffusion process (diffusion.py), the experiments
ddpm_cifar10 and ddpm_digits (experiment.py), their data (data.py) and outputs (sampling.py)."""
