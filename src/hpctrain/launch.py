"""The program every rendered job script runs: ``python -m hpctrain.launch [torchrun's arguments] -m MODULE ARGS``.

torchrun in this process with hpctrain's handling (hpctrain.launcher.torchrun). This entry point adds what the
launcher, below the commands and the training, cannot know: when the workers run hpctrain, the modules they import
(imported once here before they are forked) and the run's config, read from their command line for the failure
report and alert. Job scripts already rendered into run dirs call this path (a requeued job re-runs its old
script), as do those of earlier versions through hpctrain.dist.torchrun_main: keep it.
"""

from __future__ import annotations

import sys
from typing import Sequence

from hpctrain.launcher import torchrun
from hpctrain.launcher.arguments import worker_module


def main(argv: Sequence[str] | None = None) -> int:
    """torchrun with ``argv`` (None: sys.argv's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    module, args = worker_module(argv) or ("", [])
    if module != "hpctrain":
        return torchrun.main(argv)
    from hpctrain.commands.train import PRELOAD, config_from_argv

    return torchrun.main(argv, preload=PRELOAD, read_config=lambda: config_from_argv(args))


if __name__ == "__main__":
    from hpctrain.process_exit import run_and_exit

    run_and_exit(main)  # no interpreter finalization, where torch's threads can abort the process
