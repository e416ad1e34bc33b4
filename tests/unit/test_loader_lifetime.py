"""Loader workers end with their rank, even when the rank is killed: with forkserver their parent is the server,
not the rank, so torch's own parent watch never fires, and a leftover worker kept the server (and the job's
stdout) alive for good."""

import os
import signal
import subprocess
import sys
import time

import pytest

CHILD = r"""
import os, sys, torch
from torch.utils.data import BatchSampler, SequentialSampler, TensorDataset
from hpctrain.config.schema import DataSection
from hpctrain.data.loader import build_loader, stop_signals_blocked
from hpctrain.dist.runtime import single_process_runtime

ds = TensorDataset(torch.arange(64.0))
cfg = DataSection(num_workers=1, worker_start="forkserver")
loader = build_loader(ds, BatchSampler(SequentialSampler(ds), 4, False), cfg, single_process_runtime(torch.device("cpu")))
with stop_signals_blocked():
    it = iter(loader)
next(it)
print("ready", flush=True)
sys.stdin.read()  # wait to be killed
"""


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
def test_workers_and_forkserver_end_when_the_rank_is_killed():
    rank = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    servers: list[int] = []
    workers: list[int] = []
    try:
        assert rank.stdout.readline().strip() == "ready"
        servers = [p for p in _children(rank.pid) if "forkserver" in _cmdline(p)]
        workers = [w for s in servers for w in _children(s)]
        assert len(servers) == 1 and len(workers) == 1  # the worker's parent is the server, not the rank
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in workers + list(servers)):
            time.sleep(0.2)
        left = [p for p in workers + list(servers) if _alive(p)]
        assert not left, f"still running after the rank died: {left}"
    finally:  # whatever failed, nothing this test started outlives it
        for pid in [rank.pid, *workers, *servers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        rank.wait(10)


FORKED_AT_EXIT = """
import functools, os, torch
from torch.utils.data import DataLoader, TensorDataset
from hpctrain.data.loader import guard_stop_signals
from hpctrain.process_exit import exit_without_finalizing
loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=4, multiprocessing_context="fork",
                    persistent_workers=True, worker_init_fn=functools.partial(guard_stop_signals, rank_pid=os.getpid()))
it = iter(loader)
next(it)
print("done:", flush=True)
exit_without_finalizing(0)
"""


def test_a_finished_run_with_forked_loader_workers_exits_without_a_traceback():
    """data.worker_start=fork: the persistent workers are the rank's children; multiprocessing's exit handler ends
    them with SIGTERM and torch's SIGCHLD handler called that 'exited unexpectedly' after every `done:` (with 4 workers
    every time on this machine before the fix)."""
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", FORKED_AT_EXIT], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "done:" in done.stdout, done.stdout + done.stderr
        assert "exited unexpectedly" not in done.stderr and "Traceback" not in done.stderr, done.stderr
