"""`hpctrain sweep submit --local`: the points run here one after another, each with `hpctrain train`, how
each ended recorded in SWEEP_DIR/status/ (read by sweep/status.py)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
import time

from hpctrain.atomic import atomic_write_text
from hpctrain.sweep.spec import SweepSpec
from hpctrain.sweep.status import STATUS_DIR, is_error


def run_locally(plan: SweepSpec, nproc_per_node: int) -> int:
    """Each point in turn with `hpctrain train` (a point already finished resumes, finds nothing to do, and is
    quick); a failed point is recorded and the next one runs. Ctrl-C stops the sweep after the running point has
    saved its checkpoint: the same command goes on from there."""
    failed = 0
    for point in plan.points:
        print(f"hpctrain: sweep point {point.index + 1}/{len(plan.points)}: {point.name}", file=sys.stderr, flush=True)
        args = [sys.executable, "-m", "hpctrain", "train", plan.experiment, "--config", str(plan.config_path(point))]
        if nproc_per_node > 1:
            args += ["--nproc-per-node", str(nproc_per_node)]
        _record(plan, point.name, "running", None, "")
        code, error = _run_point(args)
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


def _record(plan: SweepSpec, name: str, state: str, code: int | None, error: str) -> None:
    (plan.sweep_dir / STATUS_DIR).mkdir(exist_ok=True)
    record = {"state": state, "exit_code": code, "error": error, "time": time.time()}
    atomic_write_text(plan.sweep_dir / STATUS_DIR / f"{name}.json", json.dumps(record) + "\n")


def _run_point(args: list[str]) -> tuple[int, str]:
    """Run one point, its output passed through; (exit code, its last error line or ''). A thread reads its stderr
    to the end, after a Ctrl-C too: a point that writes more than a pipe holds (64 KiB) while it shuts down would
    otherwise block on the full pipe, and the sweep waiting for it would never end."""
    proc = subprocess.Popen(args, stdout=None, stderr=subprocess.PIPE, text=True, errors="replace")
    last_error = [""]
    reader = threading.Thread(target=_pass_through, args=(proc.stderr, last_error), daemon=True)
    reader.start()
    interrupted = False
    while True:
        try:
            code = proc.wait()
            reader.join()
            break
        except KeyboardInterrupt:  # the point got the same SIGINT: wait for its checkpoint (after a second one too)
            interrupted = True
    return (130 if interrupted and code == 0 else code), last_error[0]


def _pass_through(stream, last_error: list[str]) -> None:
    for line in stream:
        sys.stderr.write(line)
        if is_error(line):
            last_error[0] = line.strip()
