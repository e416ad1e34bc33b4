"""`hpctrain sweep submit --local`: the points run here one after another, each with `hpctrain train`, how
each ended recorded in SWEEP_DIR/status/ (read by sweep/status.py)."""

from __future__ import annotations

import contextlib
import json
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from hpctrain.atomic import atomic_write_text
from hpctrain.config.target import ScriptTarget, is_script
from hpctrain.sweep.grid import Point
from hpctrain.sweep.spec import SweepSpec
from hpctrain.sweep.status import STATUS_DIR, is_error


def run_locally(plan: SweepSpec, nproc_per_node: int) -> int:
    """Each point in turn with `hpctrain train` (a point already finished resumes, finds nothing to do, and is
    quick); a failed point is recorded and the next one runs. Ctrl-C stops the sweep after the running point has
    saved its checkpoint: the same command goes on from there."""
    failed = 0
    for point in plan.points:
        print(f"hpctrain: sweep point {point.index + 1}/{len(plan.points)}: {point.name}", file=sys.stderr, flush=True)
        _record(plan, point.name, "running", None, "")
        code, error = _run_point(point_command(plan, point, nproc_per_node),
                                 local_log(plan, point) if is_script(plan.experiment) else None)
        interrupted = code in (130, -2)
        _record(plan, point.name, "done" if code == 0 else "stopped" if interrupted else "failed", code, error)
        if interrupted:  # Ctrl-C: the point saved and stopped; so does the sweep
            print(f"hpctrain: sweep interrupted at {point.name}; run the same command again to go on",
                  file=sys.stderr)
            return 130
        failed += code != 0
    print(f"hpctrain: sweep done: {len(plan.points) - failed} point(s) finished, {failed} failed; "
          f"{shlex.join(['hpctrain', 'report', str(plan.sweep_dir)])}", file=sys.stderr)
    return 1 if failed else 0


def point_command(plan: SweepSpec, point: Point, nproc_per_node: int) -> list[str]:
    """`hpctrain train` of a point: an experiment's with its resolved config; a script's with its settings (what
    its processes are to read, not every key) and its arguments after --."""
    nproc = ["--nproc-per-node", str(nproc_per_node)] if nproc_per_node > 1 else []
    train = [sys.executable, "-m", "hpctrain", "train"]
    target = ScriptTarget.parse(plan.experiment)
    if target is None:
        return [*train, plan.experiment, "--config", str(plan.config_path(point)), *nproc]
    what = ["--module", target.module] if target.module else ["--script", target.path]
    return [*train, *what, "--config", str(plan.settings_path(point)), *nproc, "--", *plan.script_args_of(point)]


def local_log(plan: SweepSpec, point: Point) -> Path:
    """A script's point run here: its output, kept for a metric read from the log (--metric-line)."""
    return plan.sweep_dir / "logs" / f"local_{point.name}.out"


def _record(plan: SweepSpec, name: str, state: str, code: int | None, error: str) -> None:
    (plan.sweep_dir / STATUS_DIR).mkdir(exist_ok=True)
    record = {"state": state, "exit_code": code, "error": error, "time": time.time()}
    atomic_write_text(plan.sweep_dir / STATUS_DIR / f"{name}.json", json.dumps(record) + "\n")


def _run_point(args: list[str], log: Path | None = None) -> tuple[int, str]:
    """Run one point, its output passed through (and appended to ``log``, if given); (exit code, its last error
    line or ''). Threads read its output to the end, after a Ctrl-C too: a point that writes more than a pipe holds
    (64 KiB) while it shuts down would otherwise block on the full pipe, and the sweep waiting for it would never
    end."""
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") if log is not None else contextlib.nullcontext() as kept:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE if kept else None, stderr=subprocess.PIPE, text=True,
                                errors="replace")
        last_error = [""]
        readers = [threading.Thread(target=_pass_through, args=(proc.stderr, sys.stderr, kept, last_error),
                                    daemon=True)]
        if kept is not None:
            readers.append(threading.Thread(target=_pass_through, args=(proc.stdout, sys.stdout, kept, None),
                                            daemon=True))
        for reader in readers:
            reader.start()
        interrupted = False
        while True:
            try:
                code = proc.wait()
                for reader in readers:
                    reader.join()
                break
            except KeyboardInterrupt:  # the point got the same SIGINT: wait for its checkpoint (after a second too)
                interrupted = True
    return (130 if interrupted and code == 0 else code), last_error[0]


_LOG_LOCK = threading.Lock()


def _pass_through(stream, out, kept, last_error: list[str] | None) -> None:
    for line in stream:
        out.write(line)
        if kept is not None:
            with _LOG_LOCK:  # stdout's and stderr's readers, one line at a time
                kept.write(line)
                kept.flush()
        if last_error is not None and is_error(line):
            last_error[0] = line.strip()
