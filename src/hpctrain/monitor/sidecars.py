"""Per-node monitors: ``top -b`` and, where GPUs exist, ``nvidia-smi dmon``, written to the run dir.

The HPC guides start these in the batch script, which only runs on the first node and
leaves the others unmonitored. Here each node's launcher (one per node) starts them, so
every node is recorded, and they die with it: stopped in a ``finally`` on a normal exit,
and by PR_SET_PDEATHSIG if the launcher is killed. The job script's own trap handles the
Slurm statistics (sstat/sacct/seff).
"""

from __future__ import annotations

import getpass
import os
import logging
import shutil
import socket
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hpctrain.dist.parent_death import die_with_parent
from hpctrain.dist.env import monitor_settings

log = logging.getLogger("hpctrain")

# p: power/temperature, u: utilisation (sm, mem = memory bandwidth), c: clocks, v: violations,
# m: memory used, e: ECC/PCIe replay, t: PCIe throughput. -o DT prefixes date and time.
DMON_ARGS = ["dmon", "-s", "pucvmet", "-o", "DT"]


def monitor_commands(every_s: int, gpus: bool, user: str) -> dict[str, list[str]]:
    """Log name prefix -> command."""
    commands = {"top": ["top", "-b", "-d", str(every_s), "-u", user, "-w", "200"]}
    if gpus:
        commands["dmon"] = ["nvidia-smi", *DMON_ARGS, "-d", str(every_s)]
    return commands


_running: set[int] = set()
"""pids of the monitors node_monitors runs in this process now (running_monitors)."""


def running_monitors() -> frozenset[int]:
    """The monitor processes this launcher runs now: the launcher's children that are not workers, and must not
    get the stop signals it forwards (top exits on SIGUSR2: monitoring would stop when the final save starts)."""
    return frozenset(_running)


TOP_PROCESS_LINES = 15  # per snapshot: top lists every process, which fills gigabytes in a long job


def keep_top_lines(source, sink, limit: int = TOP_PROCESS_LINES) -> None:
    """Copy top's batch output, keeping each snapshot's summary and its ``limit`` busiest processes."""
    in_table, kept = False, 0
    for line in source:
        if line.startswith(b"top - "):
            in_table, kept = False, 0
        elif line.lstrip().startswith(b"PID "):
            in_table = True
        elif in_table:
            kept += 1
            if kept > limit:
                continue
        sink.write(line)
        sink.flush()


@contextmanager
def node_monitors() -> Iterator[list[Path]]:
    """Start the monitors the job asked for (HPCTRAIN_MONITOR_DIR/EVERY), stop them on exit."""
    directory, every = monitor_settings()
    if not directory:
        yield []
        return
    host = socket.gethostname().split(".")[0]
    procs, threads, paths = [], [], []
    gpus = shutil.which("nvidia-smi") is not None
    for name, cmd in monitor_commands(every, gpus, _user()).items():
        if shutil.which(cmd[0]) is None:
            log.warning("monitor %s not started: %s is not installed on %s", name, cmd[0], host)
            continue
        path = Path(directory) / f"{name}_{host}.log"
        try:
            out = open(path, "ab")
        except OSError as err:
            log.warning("monitor %s not started: cannot write %s (%s)", name, path, err)
            continue
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=die_with_parent)
        except OSError as err:  # monitoring must never stop the launch
            out.close()
            log.warning("monitor %s not started on %s: %s", name, host, err)
            continue
        limit = TOP_PROCESS_LINES if name == "top" else 1 << 30
        thread = threading.Thread(target=_copy, args=(proc, out, limit), name=f"monitor-{name}", daemon=True)
        thread.start()
        procs.append(proc)
        _running.add(proc.pid)
        threads.append(thread)
        paths.append(path)
    try:
        yield paths
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        for thread in threads:
            thread.join(timeout=5)
        _running.difference_update(proc.pid for proc in procs)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers): top -u needs a name
        return str(os.getuid())


def _copy(proc: subprocess.Popen, out, limit: int) -> None:
    with out:
        try:
            keep_top_lines(proc.stdout, out, limit)
        except (OSError, ValueError):  # disk full or closed: monitoring must never stop training
            pass
