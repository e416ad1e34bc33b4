"""The workers' failure in one line, with the first failing worker's exit code and one alert for all ranks.

torchrun's ChildFailedError traceback and boxed summary bury the workers' own messages, and it exits 1 whatever
they said. Here: one line about the first failure, that worker's exit code (2 for bad input, 128+N for signal N),
and the failure alert once. A clean stop (every worker saved and exited with fault.exit_code) and the user's Ctrl-C
(130) are said as such, and torchrun's own `failed (exitcode: N)` line is dropped for them (CleanStopLines).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from hpctrain.launcher import signals
from hpctrain.launcher.signals import INTERRUPTED


def exit_code(worker_exitcode: int) -> int:
    if worker_exitcode < 0:
        return 128 - worker_exitcode
    return worker_exitcode or 1


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
    return message if full else error_line(message)


def error_line(message: str) -> str:
    """The line of an error file's message that says what went wrong."""
    lines = message.strip().splitlines()
    if len(lines) > 1 and lines[-1].startswith("HINT: "):
        return f"{lines[-2]} ({lines[-1]})"[:500]
    # The exception's own line, not the advice torch appends below it ("In addition, you can set the environment
    # variable TORCH_DISTRIBUTED_DEBUG ..."): torch's error file holds "Type: message" first (a later line that looks
    # like one is part of the message); a traceback's is its last such line.
    errors = [line for line in lines if ERROR_LINE.match(line)]
    return (lines[0] if ERROR_LINE.match(lines[0]) else errors[-1] if errors else lines[0])[:500]


def last_error_line(text: str, or_last: bool = True) -> str:
    """The last line of a worker's stderr that reads as an error (a traceback's exception line, 'hpctrain: error:
    ...'), else (``or_last``) its last line: what a script that writes no error file said last ('' for nothing)."""
    lines = [RANK_PREFIX.sub("", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if ERROR_LINE.match(line) or line.startswith("hpctrain: error: ")]
    return (errors or (lines if or_last else []) or [""])[-1][:500]


RANK_PREFIX = re.compile(r"^\[rank\d+\]:")
"""torch's prefix on the lines of an uncaught exception in a process of a process group."""


ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b.*?: ")

# A worker whose error says a peer went away failed because of another worker, not first.
CONSEQUENCE_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "remote worker crashing",
    "NCCL communicator was aborted", "Broken pipe",
)


def is_consequence(failure, stderr: str = "") -> bool:
    """Evidently caused by another worker's failure: torchrun's shutdown SIGTERM, or a lost peer connection (in its
    error file, or for a script in what it wrote to stderr last)."""
    message = failure_message(failure, full=True) or stderr
    return failure.exitcode == -signal.SIGTERM or any(m in message for m in CONSEQUENCE_MARKERS)


StderrOf = Callable[[int], str]
"""A script worker's last stderr by pid ('' when unknown)."""


def no_stderr(_pid: int) -> str:
    return ""


def stderr_tail(failure, stderr_of: StderrOf) -> str:
    """What the failed worker wrote to stderr last ('' when unknown)."""
    return stderr_of(getattr(failure, "pid", -1))


def first_failure(err: ChildFailedError, stderr_of: StderrOf = no_stderr):
    """(rank, failure) that caused the others. torchrun's own pick goes by timestamp, but its timestamps have
    1 s resolution, and a worker killed without an error file is stamped when torchrun notices, which can be
    after the survivors' own errors about the lost peer. So evident consequences go last."""
    return min(err.failures.items(),
               key=lambda kv: (is_consequence(kv[1], stderr_tail(kv[1], stderr_of)), kv[1].timestamp, kv[0]))


def said(failure, stderr_of: StderrOf = no_stderr) -> str:
    """What a failed worker said: its error file's line, else (a script) its last error line on stderr; for one
    killed by a signal only an exception it raised before (a script whose uncaught error ends in an abort at exit),
    not its last line of output, nor torchrun's 'Signal N received'."""
    by_signal, tail = failure.exitcode < 0, stderr_tail(failure, stderr_of)
    line = ("" if by_signal else failure_message(failure)) or last_error_line(tail, or_last=not by_signal)
    if not line and failure.exitcode == -signal.SIGABRT and ABORT_AT_EXIT in tail:
        return f"{ABORT_AT_EXIT} ({ABORT_AT_EXIT_CAUSE})"
    return line


ABORT_AT_EXIT = "terminate called without an active exception"
ABORT_AT_EXIT_CAUSE = ("a torch thread alive while the interpreter ended, pytorch/pytorch#38228: end the script with "
                       "os._exit(code) after flushing; docs/scripts.md")


def report(err: ChildFailedError, cfg=None, codes: frozenset[int] = frozenset(), stderr_of: StderrOf | None = None) -> int:
    """One line for the failure, the alert, and the exit code; ``cfg``: the run's config (None: no alert, and no
    "resume me" reading of fault.exit_code); ``codes``: the exit codes that mean "resume me" (default: fault.exit_code);
    ``stderr_of``: for a script's workers, what each wrote to stderr last (they write no error file)."""
    failures = err.failures.values()
    stuck = [r for r, f in sorted(err.failures.items())
             if f.exitcode == -signal.SIGKILL and f.pid in signals._StopGrace.killed]
    if stuck:
        return _report_stuck(err, stuck, cfg)
    script, stderr_of = stderr_of is not None, stderr_of or no_stderr
    # After Ctrl-C, a rank that was waiting in a collective can fail on its peer's exit ("Connection closed by peer")
    # before its own KeyboardInterrupt is raised: still the interrupt, not a failure.
    interrupted = {INTERRUPTED, -signal.SIGINT, -signal.SIGKILL, -signal.SIGTERM}
    # A worker stuck in C code never runs its handler: the launcher's SIGKILL after the second press ends it.
    presses = signals._Interrupts.count
    killed = sum(f.exitcode == -signal.SIGKILL and f.pid in signals._Interrupts.killed for f in failures)
    killed = killed if presses >= 2 else 0
    stopped = killed or any(f.exitcode in (INTERRUPTED, -signal.SIGINT) for f in failures)
    if presses and stopped and all(f.exitcode in interrupted or is_consequence(f, stderr_tail(f, stderr_of)) for f in failures):
        saved = "" if presses > 1 else " at a step boundary with a checkpoint"
        late = (f"; {killed} still running {signals.INTERRUPT_GRACE_S} s after the second press were killed"
                if killed else "")
        print(f"hpctrain: interrupted (Ctrl-C): all {len(err.failures)} workers stopped{saved}{late}; the same command "
              "resumes from the last checkpoint", file=sys.stderr)
        return INTERRUPTED
    codes = codes or (frozenset({cfg.fault.exit_code}) if cfg is not None else frozenset())
    ended = {f.exitcode for f in failures}
    if cfg is not None and ended <= codes:
        code = next(iter(ended)) if len(ended) == 1 else cfg.fault.exit_code
        if not script:  # Not a failure: every worker saved and asked to be resumed (rank 0 sent the alert, requeued).
            print(f"hpctrain: all {len(err.failures)} workers stopped after a checkpoint; exit code "
                  f"{cfg.fault.exit_code} means: resume me", file=sys.stderr)
        else:
            print(f"hpctrain: all {len(err.failures)} workers of the script exited with a requeue code "
                  f"({', '.join(map(str, sorted(ended)))}): a stop it asked to be resumed from, not a failure",
                  file=sys.stderr)
        return code
    return _report_first(err, cfg, stderr_of)


def _report_stuck(err: ChildFailedError, stuck: list[int], cfg) -> int:
    """A forwarded SIGTERM (a preemption) that the workers did not act on in TERM_GRACE_S: a failure, Ctrl-C or not."""
    grace = signals.TERM_GRACE_S
    ranks = ", ".join(map(str, stuck))
    others = ", ".join(f"rank {r} {describe_exit(f.exitcode)}" for r, f in sorted(err.failures.items())
                       if r not in stuck)
    print(f"hpctrain: worker rank{'s' if len(stuck) > 1 else ''} {ranks} did not stop within {grace} s "
          f"after the stop signal (SIGTERM) and {'were' if len(stuck) > 1 else 'was'} killed (SIGKILL)"
          + (f"; {others}" if others else "") + "; the workers' messages are above; a resume starts from the "
          "run's last complete checkpoint", file=sys.stderr)
    if cfg is not None:
        how = f"did not stop within {grace} s after SIGTERM, killed"
        _alert_failure(cfg, stuck[0], exit_code(-signal.SIGKILL), how, "")
    return exit_code(-signal.SIGKILL)


def _report_first(err: ChildFailedError, cfg, stderr_of: StderrOf = no_stderr) -> int:
    """The worker that failed first, what it said, and how the others ended."""
    rank, first = first_failure(err, stderr_of)
    others = ", ".join(f"rank {r} {describe_exit(f.exitcode)}" for r, f in sorted(err.failures.items()) if r != rank)
    error = said(first, stderr_of)
    print(
        f"hpctrain: worker rank {rank} (local rank {first.local_rank}, pid {first.pid}, {socket.gethostname()}) "
        f"failed first, {describe_exit(first.exitcode)}" + (f": {error}" if error else "")
        + (f"; after it: {others}" if others else "")
        + "; its messages are above.",
        file=sys.stderr,
    )
    if cfg is not None:
        _alert_failure(cfg, rank, exit_code(first.exitcode), describe_exit(first.exitcode),
                       error or failure_message(first))
    return exit_code(first.exitcode)


def outcome_record(err: ChildFailedError | None, code: int, codes: frozenset[int],
                   stderr_of: StderrOf = no_stderr) -> dict:
    """This node's record of how its workers ended (slurm/exits.py): its exit ``code`` as report() gave it, and for a
    failure the rank that failed first, how, and what it said."""
    record = {"exit_code": code, "host": socket.gethostname(), "time": time.time()}
    if err is None or not err.failures:
        return {**record, "outcome": "completed"}
    if code in codes:
        return {**record, "outcome": "requeue"}
    if code == INTERRUPTED:
        return {**record, "outcome": "interrupted"}
    rank, first = first_failure(err, stderr_of)
    return {**record, "outcome": "failed", "rank": rank, "local_rank": first.local_rank, "pid": first.pid,
            "how": describe_exit(first.exitcode), "error": said(first, stderr_of),
            "consequence": is_consequence(first, stderr_tail(first, stderr_of)), "time": float(first.timestamp or time.time()),
            "others": ", ".join(f"rank {r} {describe_exit(f.exitcode)}" for r, f in sorted(err.failures.items())
                                if r != rank)}


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
        return int(json.loads((run_dir / "heartbeat" / f"rank_{rank}.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return -1


def is_clean_stop_line(record: logging.LogRecord, codes: frozenset[int]) -> bool:
    """torchrun's ``failed (exitcode: 75) local_rank: ...`` where 75 is a stop with a checkpoint (fault.exit_code)
    or 130 (Ctrl-C): hpctrain's own line says what happened; a user reads torchrun's as an error."""
    return (isinstance(record.msg, str) and record.msg.startswith("failed (exitcode: ")
            and bool(record.args) and isinstance(record.args, tuple) and record.args[0] in codes)


class CleanStopLines(logging.Filter):
    """Drops is_clean_stop_line records from torchrun's logger; every other exit code still shows."""

    def __init__(self, codes: frozenset[int]) -> None:
        super().__init__()
        self.codes = codes

    def filter(self, record: logging.LogRecord) -> bool:
        return not is_clean_stop_line(record, self.codes)
