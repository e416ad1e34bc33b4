"""Slurm job scripts: render (pure), lint, and thin wrappers around sbatch/squeue/scontrol/scancel."""
