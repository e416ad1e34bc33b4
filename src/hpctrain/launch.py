"""torchrun, with stop signals passed to the workers and a short failure report.

This is ``torch.distributed.run.main`` itself (the same argument parsing, agent and
rendezvous). What we change, measured on torch 2.14:

- Signals. torchrun handles SIGTERM, SIGINT, SIGHUP and SIGQUIT by sending the same
  signal to its workers and SIGKILL 30 s later, then exits with a traceback instead
  of the workers' exit code. SIGUSR1/SIGUSR2 it does not handle at all: their
  default action kills torchrun, and the workers (each in a session of its own)
  never hear of it. Here SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 are forwarded to the
  worker processes (not the node monitors) and torchrun keeps running, so the workers
  stop at a step boundary, save, and exit with fault.exit_code (each of these is a stop
  signal in a worker: fault/signals.FORWARDED_STOPS), which we pass on. SIGINT (Ctrl-C)
  too: the workers stop at the next step boundary with a checkpoint and exit 130; a
  second SIGINT stops them at once (SIGKILL after INTERRUPT_GRACE_S: still the interrupt, 130). Workers still
  running TERM_GRACE_S after a forwarded SIGTERM are killed too: a failure (137, its own line). torchrun's own
  handling (SIGTERM to the workers, then a SignalException traceback and exit 1)
  threw the work since the last checkpoint away. SIGQUIT keeps torchrun's behaviour.
- Failures. Its ChildFailedError traceback and boxed summary bury the workers' own
  messages; we print one line about the first failure and exit with that worker's
  code (2 for bad input, 128+N for signal N) instead of 1, and send the failure alert
  once for all ranks. Its `failed (exitcode: N)` line is dropped where N is a clean
  stop's (fault.exit_code, 130): our own line follows and says what happened.
- Threads. One warning when OMP_NUM_THREADS x processes exceed the cores this launcher
  may use; the launcher itself runs on one intra-op thread (dist/forked_workers).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun
from torch.distributed.run import parse_args as parse_torchrun_args

from hpctrain.config.schema import FaultSection
from hpctrain.dist.env import agent_environment
from hpctrain.dist.forked_workers import LauncherThreads, fork_refusal, forked_workers, quiet_launcher
from hpctrain.dist.launcher import CleanStopLines, oversubscription, torchrun_args
from hpctrain.fault.signals import FORWARDED_STOPS, SAME_PRESS_S
from hpctrain.monitor.sidecars import node_monitors, running_monitors

FORWARDED = tuple(getattr(signal, name) for name in FORWARDED_STOPS)


def exit_code(worker_exitcode: int) -> int:
    if worker_exitcode < 0:
        return 128 - worker_exitcode
    return worker_exitcode or 1


def child_pids(pid: int | None = None) -> list[int]:
    """Direct children of ``pid`` (torchrun's workers), from /proc."""
    pid = pid or os.getpid()
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


def worker_pids() -> list[int]:
    """torchrun's workers: this process's children but the node monitors (monitor/sidecars), which stop when the
    launch ends, not when a stop signal comes."""
    monitors = running_monitors()
    return [pid for pid in child_pids() if pid not in monitors]


# After a forwarded SIGTERM the workers get this long to save and exit, then SIGKILL: torchrun's own
# backstop (30 s) is bypassed by forwarding, and a hung worker must not keep the launcher alive forever.
# Under Slurm, KillWait ends the step earlier anyway.
TERM_GRACE_S = 120


def _kill_workers() -> frozenset[int]:
    """SIGKILL to every worker still running; the pids it reached (a worker's SIGKILL is ours only if its pid is
    among them: the OOM killer's is not, even while torchrun has yet to reap it)."""
    killed = set()
    for child in worker_pids():
        if _process_state(child) in ("", "Z"):
            continue
        try:
            os.kill(child, signal.SIGKILL)
            killed.add(child)
        except ProcessLookupError:
            pass
    return frozenset(killed)


def _process_state(pid: int) -> str:
    """The process state letter (Z: dead, not yet reaped), '' when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _kill_after_stop(_signum: int = signal.SIGALRM, _frame=None) -> None:
    """TERM_GRACE_S after a forwarded SIGTERM: the workers did not stop (a failure, said as such in report)."""
    _StopGrace.killed |= _kill_workers()


def _kill_after_interrupt(_signum: int = signal.SIGALRM, _frame=None) -> None:
    """INTERRUPT_GRACE_S after the second Ctrl-C: the user's interrupt (130), not a failure."""
    _Interrupts.killed |= _kill_workers()


class _StopGrace:
    killed: frozenset[int] = frozenset()
    """Workers the launcher SIGKILLed because they were still running TERM_GRACE_S after a forwarded SIGTERM."""


# After a second Ctrl-C the workers get this long to leave (their KeyboardInterrupt), then SIGKILL.
INTERRUPT_GRACE_S = 10
INTERRUPTED = 130


def _forward(signum: int, _frame) -> None:
    for child in worker_pids():
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass
    if signum == signal.SIGTERM:
        _kill_children_in(TERM_GRACE_S, _kill_after_stop)


def _kill_children_in(seconds: int, killer=_kill_after_interrupt) -> None:
    """SIGKILL to the workers ``seconds`` from now by ``killer`` (which records why), or sooner if already due sooner
    (a later signal never gives a stuck worker more time); the kill due first keeps its reason."""
    left = signal.alarm(0)
    if left and left <= seconds and signal.getsignal(signal.SIGALRM) in KILLERS:
        signal.alarm(left)
        return
    signal.signal(signal.SIGALRM, killer)
    signal.alarm(seconds)


KILLERS = (_kill_after_stop, _kill_after_interrupt)


class _Interrupts:
    """Ctrl-C: the first is forwarded (the workers stop at a step boundary with a checkpoint), the second too (the
    workers' KeyboardInterrupt), with SIGKILL INTERRUPT_GRACE_S later for a worker that does not leave. Two SIGINTs
    within SAME_PRESS_S are one press (under Slurm the step's signal reaches this process and the workers alike)."""

    count = 0
    first_at = 0.0
    killed: frozenset[int] = frozenset()
    """Workers the launcher SIGKILLed INTERRUPT_GRACE_S after the second press (_kill_after_interrupt)."""

    @classmethod
    def handle(cls, signum: int, frame) -> None:
        now = time.monotonic()
        if cls.count and now - cls.first_at <= SAME_PRESS_S:
            return  # the same press again: the workers have it
        cls.count += 1
        cls.first_at = cls.first_at or now
        _forward(signum, frame)
        if cls.count == 2:
            _kill_children_in(INTERRUPT_GRACE_S)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def failure_message(failure, full: bool = False) -> str:
    """The worker's error from torchrun's error file (written by @record): a str, or a dict with 'message'.
    Its last line (the exception; for a UserError the line before its HINT), or all of it."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if not isinstance(message, str) or message.startswith("To enable traceback") or not message.strip():
        return ""
    if full:
        return message
    lines = message.strip().splitlines()
    if len(lines) > 1 and lines[-1].startswith("HINT: "):
        return f"{lines[-2]} ({lines[-1]})"[:500]
    # The exception's own line, not the advice torch appends below it ("In addition, you can set the environment
    # variable TORCH_DISTRIBUTED_DEBUG ..."): torch's error file holds "Type: message" first (a later line that looks
    # like one is part of the message); a traceback's is its last such line.
    errors = [line for line in lines if ERROR_LINE.match(line)]
    return (lines[0] if ERROR_LINE.match(lines[0]) else errors[-1] if errors else lines[0])[:500]


ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b.*?: ")


def _run_config():
    """The config of the hpctrain command torchrun runs (from our argv), or None if it cannot be read."""
    try:
        from hpctrain.cli import request_from_argv
        from hpctrain.train.entry import resolve

        req = request_from_argv(sys.argv[sys.argv.index("hpctrain") + 1:])
        return resolve(req.experiment, req.config_file, req.overrides)[1]
    except (Exception, SystemExit):
        return None


# A worker whose error says a peer went away failed because of another worker, not first.
CONSEQUENCE_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "remote worker crashing",
    "NCCL communicator was aborted", "Broken pipe",
)


def is_consequence(failure) -> bool:
    """Evidently caused by another worker's failure: torchrun's shutdown SIGTERM, or a lost peer connection."""
    return failure.exitcode == -signal.SIGTERM or any(m in failure_message(failure, full=True) for m in CONSEQUENCE_MARKERS)


def first_failure(err: ChildFailedError):
    """(rank, failure) that caused the others. torchrun's own pick goes by timestamp, but its timestamps have
    1 s resolution, and a worker killed without an error file is stamped when torchrun notices, which can be
    after the survivors' own errors about the lost peer. So evident consequences go last."""
    return min(err.failures.items(), key=lambda kv: (is_consequence(kv[1]), kv[1].timestamp, kv[0]))


def report(err: ChildFailedError, cfg=None) -> int:
    """One line for the failure, the alert, and the exit code; ``cfg``: the run's config (None: no alert, and no
    "resume me" reading of fault.exit_code)."""
    rank, first = first_failure(err)
    codes = {f.exitcode for f in err.failures.values()}
    # After Ctrl-C, a rank that was waiting in a collective can fail on its peer's exit ("Connection closed by peer")
    # before its own KeyboardInterrupt is raised: still the interrupt, not a failure.
    interrupted = {INTERRUPTED, -signal.SIGINT, -signal.SIGKILL, -signal.SIGTERM}
    failures = err.failures.values()
    stuck = [r for r, f in sorted(err.failures.items()) if f.exitcode == -signal.SIGKILL and f.pid in _StopGrace.killed]
    if stuck:
        # A forwarded SIGTERM (a preemption) that the workers did not act on in TERM_GRACE_S: a failure, Ctrl-C or not.
        ranks = ", ".join(map(str, stuck))
        others = ", ".join(f"rank {r} {describe_exit(f.exitcode)}" for r, f in sorted(err.failures.items())
                           if r not in stuck)
        print(f"hpctrain: worker rank{'s' if len(stuck) > 1 else ''} {ranks} did not stop within {TERM_GRACE_S} s "
              f"after the stop signal (SIGTERM) and {'were' if len(stuck) > 1 else 'was'} killed (SIGKILL)"
              + (f"; {others}" if others else "") + "; the workers' messages are above; a resume starts from the "
              "run's last complete checkpoint", file=sys.stderr)
        if cfg is not None:
            _alert_failure(cfg, stuck[0], exit_code(-signal.SIGKILL),
                           f"did not stop within {TERM_GRACE_S} s after SIGTERM, killed", "")
        return exit_code(-signal.SIGKILL)
    # A worker stuck in C code never runs its handler: the launcher's SIGKILL after the second press ends it.
    killed = sum(f.exitcode == -signal.SIGKILL and f.pid in _Interrupts.killed for f in failures)
    killed = killed if _Interrupts.count >= 2 else 0
    stopped = killed or any(f.exitcode in (INTERRUPTED, -signal.SIGINT) for f in failures)
    if _Interrupts.count and stopped and all(f.exitcode in interrupted or is_consequence(f) for f in failures):
        saved = "" if _Interrupts.count > 1 else " at a step boundary with a checkpoint"
        late = f"; {killed} still running {INTERRUPT_GRACE_S} s after the second press were killed" if killed else ""
        print(f"hpctrain: interrupted (Ctrl-C): all {len(err.failures)} workers stopped{saved}{late}; the same command "
              "resumes from the last checkpoint", file=sys.stderr)
        return INTERRUPTED
    if cfg is not None and codes == {cfg.fault.exit_code}:
        # Not a failure: every worker saved and asked to be resumed (rank 0 sent the alert, requeued).
        print(f"hpctrain: all {len(err.failures)} workers stopped after a checkpoint; exit code "
              f"{cfg.fault.exit_code} means: resume me", file=sys.stderr)
        return cfg.fault.exit_code
    others = ", ".join(f"rank {r} {describe_exit(f.exitcode)}" for r, f in sorted(err.failures.items()) if r != rank)
    error = failure_message(first)
    print(
        f"hpctrain: worker rank {rank} (local rank {first.local_rank}, pid {first.pid}, {socket.gethostname()}) "
        f"failed first, {describe_exit(first.exitcode)}" + (f": {error}" if error and first.exitcode > 0 else "")
        + (f"; after it: {others}" if others else "")
        + "; its messages are above.",
        file=sys.stderr,
    )
    if cfg is not None:
        _alert_failure(cfg, rank, exit_code(first.exitcode), describe_exit(first.exitcode), failure_message(first))
    return exit_code(first.exitcode)


def _alert_failure(cfg, rank: int, code: int, how: str, message: str) -> None:
    """The failure alert, from the launcher: one alert for the job, even when the worker died without a word."""
    try:
        from hpctrain.fault.alerts import Alerter, resolve_webhook

        alerter = Alerter(resolve_webhook(cfg.alert), cfg.alert, cfg.run_name, cfg.run_dir,
                          os.environ.get("SLURM_JOB_ID", ""), rank)
        alerter.send("failure", last_step=_last_step(Path(cfg.run_dir), rank), exit_code=code,
                     detail=f"rank {rank} {how}" + (f": {message}" if message else ""))
    except Exception as err:  # an alert must never hide the failure it reports
        print(f"hpctrain: could not send the failure alert: {type(err).__name__}", file=sys.stderr)


def _last_step(run_dir: Path, rank: int) -> int:
    try:
        import json

        return int(json.loads((run_dir / "heartbeat" / f"rank_{rank}.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return -1


def main(argv: list[str] | None = None, cfg=None, threads: LauncherThreads | None = None) -> int:
    """torchrun with ``argv``, or with sys.argv's as ``python -m hpctrain.launch``; ``cfg``: the run's config for
    the failure report and alert (read from sys.argv's hpctrain command when run as a program); ``threads``: the
    launcher's threads from before it imported user code (None: it has not, and they are taken now)."""
    threads = threads or quiet_launcher()
    # torchrun copies the failing worker's error file here; without one it logs that it has nowhere to copy.
    error_dir = tempfile.mkdtemp(prefix="hpctrain-torchrun-")
    as_program = argv is None
    # torchrun registers its handlers (raise, shut the workers down) for the signals in this list when it
    # starts; the others stay ours. Its --signals-to-handle overrides TORCHELASTIC_SIGNALS_TO_HANDLE.
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith(("--signals-to-handle", "--signals_to_handle")) for a in argv):
        argv.insert(0, "--signals-to-handle=SIGQUIT")
    if not _keeps_worker_logs(argv):
        # torchrun's default is a new /tmp/torchelastic_* folder per launch that nothing removes; this one goes
        # with error_dir when the launch ends
        argv.insert(0, f"--log-dir={os.path.join(error_dir, 'torchelastic')}")
    # a launch's presses and kills are its own
    _Interrupts.count, _Interrupts.first_at, _Interrupts.killed, _StopGrace.killed = 0, 0.0, frozenset(), frozenset()
    _warn_oversubscription(argv)
    quiet = CleanStopLines(frozenset({INTERRUPTED, cfg.fault.exit_code if cfg is not None else DEFAULT_EXIT_CODE}))
    TORCHRUN_LOG.addFilter(quiet)
    previous = {sig: signal.getsignal(sig) for sig in (*FORWARDED, signal.SIGINT, signal.SIGQUIT, signal.SIGALRM)}
    for sig in FORWARDED:
        signal.signal(sig, _forward)
    signal.signal(signal.SIGINT, _Interrupts.handle)
    try:
        # workers forked from this process where no CUDA device is visible and no thread forbids it (checked before
        # the monitors' reader threads start: those are the launcher's own); monitors: if asked for
        with agent_environment(os.path.join(error_dir, "error.json")), \
                forked_workers(fork_refusal() is None, _worker_entry, WORKER_IMPORTS, threads), node_monitors():
            torchrun(argv)
    except ChildFailedError as err:
        return report(err, cfg if cfg is not None or not as_program else _run_config())
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)
        _restore_handlers(previous)
        TORCHRUN_LOG.removeFilter(quiet)
    return 0


# torchrun's `failed (exitcode: N)` line comes from here; for a clean stop's code hpctrain's own line is the one
TORCHRUN_LOG = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
DEFAULT_EXIT_CODE = FaultSection().exit_code
"""The clean-stop code when the launcher runs without the run's config (python -m hpctrain.launch)."""


def _warn_oversubscription(argv: Sequence[str]) -> None:
    """One line when the workers' threads outnumber the cores this launcher (and so its workers) may use."""
    try:
        nproc = int(parse_torchrun_args(list(argv)).nproc_per_node)
    except (ValueError, SystemExit):  # auto, gpu, cpu: torchrun's own counts; bad arguments: torchrun says so
        return
    line = oversubscription(nproc, dict(os.environ), len(os.sched_getaffinity(0)))
    if line:
        print(line, file=sys.stderr)


def _keeps_worker_logs(argv: Sequence[str]) -> bool:
    """Whether torchrun is told where its logs go or to write the workers' output to files (flags or PET_*
    variables): then its log folder is the user's, not a temporary one."""
    own = list(argv[:argv.index("-m")] if "-m" in argv else argv)  # torchrun's, not the program's
    flags = ("--log-dir", "--log_dir", "--redirects", "-r", "--tee", "-t")
    given = any(a == f or a.startswith(f + "=") or (len(f) == 2 and a.startswith(f)) for a in own for f in flags)
    return given or any(os.environ.get(v) for v in ("PET_LOG_DIR", "PET_REDIRECTS", "PET_TEE"))


# What a worker imports before its first step (the training loop; DCP and through it DTensor and SymPy): imported
# once in the launcher when the workers are its forks (dist/forked_workers).
WORKER_IMPORTS = ("torch.distributed.checkpoint", "hpctrain.train.run")


def _worker_entry() -> None:
    """`python -m hpctrain` in a forked worker."""
    from hpctrain.cli import entry_point

    entry_point()


def _restore_handlers(previous: dict) -> None:
    """The caller's handlers again (torchrun's for SIGQUIT too); the workers' SIGKILL timer cancelled if armed
    (first the handlers that arm it, so none can arm it again)."""
    for sig, handler in previous.items():
        if sig != signal.SIGALRM:
            signal.signal(sig, handler)
    if signal.getsignal(signal.SIGALRM) in KILLERS:
        signal.alarm(0)
    signal.signal(signal.SIGALRM, previous[signal.SIGALRM])


def launch_local(nproc_per_node: int, module_args: Sequence[str], cfg=None,
                 threads: LauncherThreads | None = None) -> int:
    """`hpctrain train|eval|sample|doctor --nproc-per-node N`: torchrun in this process, which has imported torch
    already; a child process for it cost one more Python start and torch import per launch (about 2.5 s here).
    ``threads``: quiet_launcher's record, taken before this process imported the experiment's module."""
    return main(torchrun_args(nproc_per_node, module_args), cfg, threads)


if __name__ == "__main__":
    from hpctrain.process_exit import run_and_exit

    run_and_exit(main)  # no interpreter finalization, where torch's threads can abort the process
