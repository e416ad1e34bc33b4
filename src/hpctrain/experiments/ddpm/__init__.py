"""DDPM on CIFAR-10 (reference experiment). So far: the U-Net, used by benchmarks/checkpoint.py."""
