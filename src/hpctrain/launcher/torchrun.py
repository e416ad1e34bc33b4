"""torchrun in this process (``torch.distributed.run.main`` itself: its argument parsing, agent and rendezvous),
with hpctrain's handling around it.

- stop signals are forwarded to the workers, and workers that do not stop are killed after a grace (signals);
- a failure is one line, the first failing worker's exit code and one alert (failures);
- one warning when OMP_NUM_THREADS x processes exceed the cores this launcher may use (arguments); the launcher
  itself runs on one intra-op thread (fork_safety.quiet_launcher);
- where it is safe, the workers are forks of this process, which imported ``preload`` once for all (forked_workers).
The caller (an entry point or a command) says what to preload and how to read the run's config for the alert.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from typing import Callable, Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun
from torch.distributed.run import parse_args as parse_torchrun_args

from hpctrain.config.schema import FaultSection, RunConfig
from hpctrain.dist.env import agent_environment
from hpctrain.launcher.arguments import oversubscription, torchrun_args, with_defaults
from hpctrain.launcher.failures import CleanStopLines, report
from hpctrain.launcher.fork_safety import LauncherThreads, fork_refusal, quiet_launcher
from hpctrain.launcher.forked_workers import forked_workers
from hpctrain.launcher.signals import INTERRUPTED, forwarding, restore_handlers
from hpctrain.monitor.sidecars import node_monitors

# torchrun's `failed (exitcode: N)` line comes from here; for a clean stop's code hpctrain's own line is the one
TORCHRUN_LOG = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
DEFAULT_EXIT_CODE = FaultSection().exit_code
"""The clean-stop code when the launcher runs without the run's config (python -m hpctrain.launch)."""


def main(argv: Sequence[str] | None = None, cfg: RunConfig | None = None, threads: LauncherThreads | None = None,
         preload: Sequence[str] = (), read_config: Callable[[], RunConfig | None] | None = None) -> int:
    """torchrun with ``argv`` (None: sys.argv's); ``cfg``: the run's config for the failure report and alert, else
    ``read_config()``'s, called only for a failure (an error in it: no config); ``threads``: the launcher's threads
    from before it imported user code (None: it has not, and they are taken now); ``preload``: the modules the
    workers import, imported here once before they are forked."""
    threads = threads or quiet_launcher()
    # torchrun copies the failing worker's error file here; without one it logs that it has nowhere to copy.
    error_dir = tempfile.mkdtemp(prefix="hpctrain-torchrun-")
    argv = with_defaults(sys.argv[1:] if argv is None else argv, os.path.join(error_dir, "torchelastic"))
    _warn_oversubscription(argv)
    quiet = CleanStopLines(frozenset({INTERRUPTED, cfg.fault.exit_code if cfg is not None else DEFAULT_EXIT_CODE}))
    TORCHRUN_LOG.addFilter(quiet)
    previous = forwarding()
    try:
        # workers forked from this process where no CUDA device is visible and no thread forbids it (checked before
        # the monitors' reader threads start: those are the launcher's own); monitors: if asked for
        with agent_environment(os.path.join(error_dir, "error.json")), \
                forked_workers(fork_refusal() is None, preload, threads), node_monitors():
            torchrun(argv)
    except ChildFailedError as err:
        return report(err, cfg if cfg is not None else _read(read_config))
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)
        restore_handlers(previous)
        TORCHRUN_LOG.removeFilter(quiet)
    return 0


def launch_local(nproc_per_node: int, module_args: Sequence[str], cfg: RunConfig | None = None,
                 threads: LauncherThreads | None = None, preload: Sequence[str] = ()) -> int:
    """`hpctrain train|eval|sample|doctor --nproc-per-node N`: torchrun in this process, which has imported torch
    already; a child process for it cost one more Python start and torch import per launch (BENCHMARKS.md).
    ``threads``: quiet_launcher's record, taken before this process imported the experiment's module."""
    return main(torchrun_args(nproc_per_node, module_args), cfg, threads, preload)


def _read(read_config: Callable[[], RunConfig | None] | None) -> RunConfig | None:
    """The run's config for the failure report, or None when there is no reader or it fails (the report goes on)."""
    if read_config is None:
        return None
    try:
        return read_config()
    except (Exception, SystemExit):
        return None


def _warn_oversubscription(argv: Sequence[str]) -> None:
    """One line when the workers' threads outnumber the cores this launcher (and so its workers) may use."""
    try:
        nproc = int(parse_torchrun_args(list(argv)).nproc_per_node)
    except (ValueError, SystemExit):  # auto, gpu, cpu: torchrun's own counts; bad arguments: torchrun says so
        return
    line = oversubscription(nproc, dict(os.environ), len(os.sched_getaffinity(0)))
    if line:
        print(line, file=sys.stderr)
