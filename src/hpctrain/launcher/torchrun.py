"""torchrun in this process (``torch.distributed.run.main`` itself: its argument parsing, agent and rendezvous),
with hpctrain's handling around it.

- stop signals are forwarded to the workers, and workers that do not stop are killed after a grace (signals);
- a failure is one line, the first failing worker's exit code and one alert (failures);
- one warning when OMP_NUM_THREADS x processes exceed the cores this launcher may use (arguments); the launcher
  itself runs on one intra-op thread (fork_safety.quiet_launcher);
- where it is safe, the workers are forks of this process, which imported ``preload`` once for all (forked_workers);
- workers that run a user's script (ScriptLaunch) start as torchrun starts them, with their stderr's last lines kept
  and a requeue exit held until their siblings have ended (script_workers), and the node's outcome recorded for
  the job's batch shell and `hpctrain slurm status` (slurm/exits).
The caller (an entry point or a command) says what to preload and how to read the run's config for the alert.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun
from torch.distributed.run import parse_args as parse_torchrun_args

from hpctrain.config.schema import FaultSection, RunConfig
from hpctrain.dist.env import ScriptStep, agent_environment
from hpctrain.launcher.arguments import oversubscription, torchrun_args, with_defaults
from hpctrain.launcher.failures import CleanStopLines, no_stderr, outcome_record, report
from hpctrain.launcher.fork_safety import LauncherThreads, fork_refusal, quiet_launcher
from hpctrain.launcher.forked_workers import forked_workers
from hpctrain.launcher.script_workers import ScriptWorkers, script_workers
from hpctrain.launcher.signals import INTERRUPTED, forwarding, restore_handlers
from hpctrain.monitor.sidecars import node_monitors
from hpctrain.slurm.exits import write_record

# torchrun's `failed (exitcode: N)` line comes from here; for a clean stop's code hpctrain's own line is the one
TORCHRUN_LOG = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
DEFAULT_EXIT_CODE = FaultSection().exit_code
"""The clean-stop code when the launcher runs without the run's config (python -m hpctrain.launch)."""


@dataclass(frozen=True, kw_only=True)
class ScriptLaunch:
    """A launch whose workers run a user's script, not hpctrain."""

    codes: frozenset[int]
    """Exit codes with which the script asks to be requeued (fault.exit_code and fault.requeue_exit_codes)."""
    step: ScriptStep = field(default_factory=ScriptStep)
    """What the job's batch shell said (dist/env.script_step): where to record the node's outcome, whether to pass
    signals on. The defaults (record nothing, forward) are a local launch's."""


def main(argv: Sequence[str] | None = None, cfg: RunConfig | None = None, threads: LauncherThreads | None = None,
         preload: Sequence[str] = (), read_config: Callable[[], RunConfig | None] | None = None,
         script: ScriptLaunch | None = None) -> int:
    """torchrun with ``argv`` (None: sys.argv's); ``cfg``: the run's config for the failure report and alert, else
    ``read_config()``'s, called only for a failure (an error in it: no config); ``threads``: the launcher's threads
    from before it imported user code (None: it has not, and they are taken now); ``preload``: the modules the
    workers import, imported here once before they are forked; ``script``: the workers run a user's script."""
    threads = threads or quiet_launcher()
    # torchrun copies the failing worker's error file here; without one it logs that it has nowhere to copy.
    error_dir = tempfile.mkdtemp(prefix="hpctrain-torchrun-")
    argv = with_defaults(sys.argv[1:] if argv is None else argv, os.path.join(error_dir, "torchelastic"))
    _warn_oversubscription(argv)
    codes = script.codes if script is not None else \
        frozenset({cfg.fault.exit_code if cfg is not None else DEFAULT_EXIT_CODE})
    quiet = CleanStopLines(frozenset({INTERRUPTED, *codes}))
    TORCHRUN_LOG.addFilter(quiet)
    previous = forwarding(script is None or script.step.forward_signals)
    workers: ScriptWorkers | None = None
    try:
        # workers forked from this process where no CUDA device is visible and no thread forbids it (checked before
        # the monitors' reader threads start: those are the launcher's own); a script's as new Pythons; monitors:
        # if asked for
        started = script_workers(codes, script.step) if script is not None else \
            forked_workers(fork_refusal() is None, preload, threads)
        with agent_environment(os.path.join(error_dir, "error.json")), started as workers, node_monitors():
            torchrun(argv)
    except ChildFailedError as err:
        # a script's workers: their stderr tails (none where torch's handler factory could not be replaced)
        stderr_of = (workers.stderr_of if isinstance(workers, ScriptWorkers) else no_stderr) if script else None
        code = report(err, cfg if cfg is not None else _read(read_config), codes, stderr_of)
        return _ended(script, code, err, stderr_of)
    except Exception as exc:  # torchrun itself failed (a rendezvous error): the node's record says so, then it shows
        if script is not None and script.step.exits_dir:
            _record_launcher_error(script, exc)
        raise
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)
        restore_handlers(previous)
        TORCHRUN_LOG.removeFilter(quiet)
    return _ended(script, 0, None, None)


def _ended(script: ScriptLaunch | None, code: int, err: ChildFailedError | None, stderr_of) -> int:
    """The launcher's exit code; in a script job's step, after recording the node's outcome for its batch shell,
    which requeues: a requeue stop exits 0 there (srun --kill-on-bad-exit would kill the nodes still recording
    theirs), what it was is in the record."""
    if script is None or not script.step.exits_dir:
        return code
    try:
        write_record(script.step.exits_dir, script.step.node_id,
                     outcome_record(err, code, script.codes, stderr_of or no_stderr))
    except OSError as exc:  # the run dir unwritable: the batch shell then finds no record and does not requeue
        print(f"hpctrain: could not record how this node's ranks ended in {script.step.exits_dir}: {exc}",
              file=sys.stderr)
        return code or 1
    return 0 if code in script.codes else code


def _record_launcher_error(script: ScriptLaunch, exc: Exception) -> None:
    # A rendezvous that fails mid-run lost its store: the first node's torchrun, gone because its ranks failed.
    record = {"exit_code": 1, "outcome": "failed", "host": socket.gethostname(), "time": time.time(),
              "how": "its launcher (torchrun) failed", "error": f"{type(exc).__name__}: {exc}"[:500],
              "consequence": "Rendezvous" in type(exc).__name__}
    with contextlib.suppress(OSError):
        write_record(script.step.exits_dir, script.step.node_id, record)


def launch_local(nproc_per_node: int, module_args: Sequence[str], cfg: RunConfig | None = None,
                 threads: LauncherThreads | None = None, preload: Sequence[str] = ()) -> int:
    """`hpctrain train|eval|sample|doctor --nproc-per-node N`: torchrun in this process, which has imported torch
    already; a child process for it cost one more Python start and torch import per launch (BENCHMARKS.md).
    ``threads``: quiet_launcher's record, taken before this process imported the experiment's module."""
    return main(torchrun_args(nproc_per_node, module_args), cfg, threads, preload)


def launch_script(nproc_per_node: int, program: Sequence[str], cfg: RunConfig) -> int:
    """`hpctrain train --script PATH --nproc-per-node N -- ARGS`: torchrun here over ``program`` (PATH ARGS, or
    -m MODULE ARGS), its workers the script's, its requeue codes the config's."""
    return main(["--standalone", f"--nproc-per-node={nproc_per_node}", *program], cfg,
                script=ScriptLaunch(codes=cfg.fault.requeue_codes))


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
