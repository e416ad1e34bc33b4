"""How a command that runs on N processes (train, eval, sample) starts: with --nproc-per-node N > 1 from a plain
shell it starts torchrun's workers here (launcher.torchrun), each of which runs the same command again; inside
torchrun or srun, or on one process, this process does its share of the work."""

from __future__ import annotations

import contextlib
import importlib
import logging
from pathlib import Path
from typing import Callable, Protocol, Sequence

from hpctrain.config.schema import RunConfig
from hpctrain.dist.env import LaunchInfo, detect_launch
from hpctrain.dist.runtime import Runtime, distributed_session
from hpctrain.experiments import Experiment
from hpctrain.fault.error_file import record_errors
from hpctrain.launcher.fork_safety import quiet_launcher
from hpctrain.logs import setup_logging
from hpctrain.train.rundir import removed_if_left_empty

log = logging.getLogger("hpctrain")


class ProcessRequest(Protocol):
    nproc_per_node: int
    debug: bool

    def module_args(self) -> list[str]:
        """The same command for the workers that torchrun starts (without --nproc-per-node)."""


Resolve = Callable[[], "tuple[type[Experiment], RunConfig]"]
Check = Callable[[RunConfig, int], None]
"""What can be known wrong before any process starts, for a config and a world size."""
Work = Callable[[type[Experiment], RunConfig, Runtime], int]
"""This process's share of the work, inside the process group; returns the exit code."""


def run_on_processes(req: ProcessRequest, resolve: Resolve, check: Check, work: Work, *, alert: bool,
                     preload: Sequence[str]) -> int:
    """Resolve the config, then start torchrun here or do this process's share. ``alert``: the launcher's failure
    alert and "resume me" exit read the config (the run's training and evaluation, not a sampling); ``preload``:
    the modules the work imports, imported before the workers fork (or, here, before the rendezvous)."""
    launch = detect_launch()
    local = launch.launcher == "single" and req.nproc_per_node > 1
    # Before the experiment's module is imported: its module-level tensor ops must not start an OpenMP team that
    # the forked workers would inherit without its threads (launcher/fork_safety).
    threads = quiet_launcher() if local else None
    cls, cfg = resolve()
    # The user's own command, not a rank that torchrun or srun started: a run dir it creates and leaves empty goes.
    with removed_if_left_empty(Path(cfg.run_dir)) if launch.launcher == "single" else contextlib.nullcontext():
        if not local:
            return _run_here(cls, cfg, launch, req, check, work, preload)
        setup_logging(debug=req.debug)
        check(cfg, req.nproc_per_node)
        log.info("starting %d processes with torchrun", req.nproc_per_node)
        from hpctrain.launcher.torchrun import launch_local

        return launch_local(req.nproc_per_node, req.module_args(), cfg if alert else None, threads, preload)


# torchrun's error file, written atomically: the launcher's failure report and alert then carry this rank's error
@record_errors
def _run_here(cls: type[Experiment], cfg: RunConfig, launch: LaunchInfo, req: ProcessRequest, check: Check,
              work: Work, preload: Sequence[str]) -> int:
    setup_logging(launch.rank, launch.world_size, launch.hostname, req.debug)
    if req.nproc_per_node and launch.launcher != "single" and req.nproc_per_node != launch.local_world_size:
        log.warning(
            "--nproc-per-node=%d ignored: already launched by %s with %d processes on this node",
            req.nproc_per_node, launch.launcher, launch.local_world_size,
        )
    # Every rank checks (cheap, same verdict everywhere), so no rank waits in the rendezvous for a peer that quit.
    check(cfg, launch.world_size)
    for module in preload:  # heavy imports only where work happens, before the rendezvous
        importlib.import_module(module)
    with distributed_session(launch, cfg.dist) as runtime:
        return work(cls, cfg, runtime)
