"""Moved to ``hpctrain.launch`` (the program composes the launcher with the commands, so it lives above them, not
in dist/). Kept so that job scripts rendered by earlier versions, and requeued jobs that re-run them, still start:
``python -m hpctrain.dist.torchrun_main`` runs ``python -m hpctrain.launch``."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("hpctrain.launch", run_name="__main__", alter_sys=True)
