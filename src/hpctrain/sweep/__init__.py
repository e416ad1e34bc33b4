"""Sweeps: a grid of settings as one Slurm job array (or, with --local, one run after another here)."""
