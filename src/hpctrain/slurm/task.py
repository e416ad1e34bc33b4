"""Moved to ``hpctrain.srun_task`` (it runs the CLI, so it lives with the entry points, not in slurm/). Kept so that
``slurm.launcher=srun`` job scripts, rendered ones and requeued ones that re-run them, still start:
``python -m hpctrain.slurm.task ARGS`` runs ``python -m hpctrain.srun_task ARGS``."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("hpctrain.srun_task", run_name="__main__", alter_sys=True)
