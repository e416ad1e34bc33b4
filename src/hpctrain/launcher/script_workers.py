"""torchrun's workers when they run a user's script (--script, --module): each started as torchrun starts it (a
new Python running the script), with two things torchrun lacks.

- Its stderr passes through the launcher, which keeps the last lines (StderrTail): a script writes no error file
  (that takes torch's @record), so the failure report takes the failing rank's own error line from there.
- A worker that exits with a requeue code (fault.exit_code, fault.requeue_exit_codes) is held back from torchrun
  until the node's other workers have exited too, and in a multi-node Slurm job every other node's (StopGroup), or
  STOP_GRACE_S has passed. torchrun SIGTERMs every remaining worker at the first non-zero exit, which would kill a
  rank that is still saving its checkpoint (only rank 0 saves, the others exit at once: the common script); and a
  node whose torchrun ends first takes the rendezvous store (hosted by the first node's agent, which the other
  agents poll) down with it.

The workers are Popen's, as torchrun's own: this replaces torch's module-level handler factory for the launch, as
forked_workers does for hpctrain's own workers, and only where that factory has the parameters expected.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from hpctrain.atomic import atomic_write_text
from hpctrain.dist.env import ScriptStep
from hpctrain.launcher.forked_workers import torch_subprocess_api, wait_by_polling

STOP_GRACE_S = 60.0
"""How long a worker's requeue exit is held back while its siblings (on this node, or on others) have not ended:
after it, torchrun hears of it and stops the rest, a failure unless they too stopped with a requeue code."""
STORE_LINGER_S = 2.0
"""The first node, whose agent hosts torchrun's rendezvous store, lets its stop be known this long after every node
stopped: the other agents read the store about once a second until theirs is known, and fail when it is gone."""
TAIL_BYTES = 16384
"""How much of each worker's stderr the launcher keeps for the failure report."""
NODE_CHECK_S = 0.25
"""How often a held stop looks for the other nodes' stop markers (files in the shared run dir)."""


class StderrTail:
    """A worker's stderr pipe copied to the launcher's stderr as it comes (the bytes unchanged: a progress bar's
    carriage returns too), its last TAIL_BYTES kept."""

    def __init__(self, pipe: Any, out_fd: int = 2) -> None:
        self._pipe = pipe
        self._out = out_fd
        self._tail = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._copy, name="hpctrain-worker-stderr", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        writable = True
        try:
            while chunk := os.read(self._pipe.fileno(), 65536):
                writable = writable and _write_all(self._out, chunk)  # an unwritable log must not block the worker
                with self._lock:
                    self._tail += chunk
                    del self._tail[:-TAIL_BYTES]
        except OSError:
            pass
        finally:
            self._pipe.close()

    def text(self, wait_s: float = 2.0) -> str:
        """The last TAIL_BYTES the worker wrote, after waiting up to ``wait_s`` for its end of the pipe (a child of
        the worker that inherited its stderr may keep it open)."""
        self._thread.join(wait_s)
        with self._lock:
            return self._tail.decode(errors="replace")


def _write_all(fd: int, data: bytes) -> bool:
    try:
        while data:
            data = data[os.write(fd, data):]
        return True
    except OSError:
        return False


@dataclass
class StopGroup:
    """The workers of one launch, and whether a worker's requeue exit is held back from torchrun yet."""

    codes: frozenset[int]
    """Exit codes that ask for a requeue."""
    step: ScriptStep = field(default_factory=ScriptStep)
    """The node's place in a Slurm job (the other nodes' stop markers are in step.exits_dir)."""
    grace_s: float = STOP_GRACE_S
    members: list["HeldProcess"] = field(default_factory=list)
    released: bool = False
    """Set once nothing is held any more (all ended, a failure, the grace over, or torchrun stopping the workers)."""
    held_since: float = 0.0
    checked_at: float = 0.0
    all_nodes_at: float = 0.0

    def holds(self, code: int) -> bool:
        """Whether a worker that exited with ``code`` is still reported as running."""
        if self.released or code not in self.codes:
            return False
        now = time.monotonic()
        self.held_since = self.held_since or now
        exits = [m.exit_code() for m in self.members]
        if now - self.held_since >= self.grace_s or any(c not in self.codes and c not in (None, 0) for c in exits):
            return self.release()  # the grace is over, or a sibling failed: torchrun reports them all now
        if any(c is None for c in exits):
            return True  # a sibling still runs (saving, perhaps)
        if self.step.num_nodes > 1 and self.step.exits_dir:
            return not self._every_node_stopped(now)
        return self.release()

    def release(self) -> bool:
        self.released = True
        return False

    def _every_node_stopped(self, now: float) -> bool:
        """This node's marker written, every node's found (looked for every NODE_CHECK_S); the first node, which
        hosts the rendezvous store, goes STORE_LINGER_S after the others may."""
        if not self.all_nodes_at and now - self.checked_at >= NODE_CHECK_S:
            self.checked_at = now
            folder = Path(self.step.exits_dir)
            marker = folder / f"node{self.step.node_id}.stopped"
            with contextlib.suppress(OSError):
                if not marker.exists():
                    atomic_write_text(marker, f"{os.getpid()}\n")
                if len(list(folder.glob("node*.stopped"))) >= self.step.num_nodes:
                    self.all_nodes_at = now
        if not self.all_nodes_at:
            return False
        return self.step.node_id != 0 or now - self.all_nodes_at >= STORE_LINGER_S


class HeldProcess:
    """What torchrun uses of a Popen (pid, args, poll, wait, send_signal, terminate, kill), with poll() saying
    "still running" while the group holds the worker's requeue exit back."""

    def __init__(self, popen: subprocess.Popen, group: StopGroup) -> None:
        self._popen = popen
        self._group = group
        group.members.append(self)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def args(self) -> Any:
        return self._popen.args

    def exit_code(self) -> int | None:
        """The worker's real state: None while it runs, else its exit code (negative: killed by that signal)."""
        return self._popen.poll()

    def poll(self) -> int | None:
        code = self._popen.poll()
        return None if code is not None and self._group.holds(code) else code

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float | None = None) -> int:
        return wait_by_polling(self, timeout)

    def send_signal(self, sig: int) -> None:
        self._popen.send_signal(sig)

    def terminate(self) -> None:
        self._popen.terminate()

    def kill(self) -> None:
        self._popen.kill()


@dataclass
class ScriptWorkers:
    """The launch's script workers: their stop group, and each one's stderr tail by pid."""

    group: StopGroup
    tails: dict[int, StderrTail] = field(default_factory=dict)

    def stderr_of(self, pid: int) -> str:
        """The last of what worker ``pid`` wrote to stderr ('' if it was not ours to read)."""
        tail = self.tails.get(pid)
        return tail.text() if tail is not None else ""


@contextlib.contextmanager
def script_workers(codes: frozenset[int], step: ScriptStep) -> Iterator[ScriptWorkers | None]:
    """Within: torchrun's workers are started by the handler of this module (stderr tailed, requeue exits held).
    Yields the launch's ScriptWorkers, or None where this torch's factory is not the one expected (then torchrun's
    own starts them, and the report has no error line of the script's)."""
    api = torch_subprocess_api()
    if api is None:
        print("hpctrain: this torch's torchrun has no subprocess handler factory with the parameters hpctrain "
              "expects; the script's workers start without their stderr kept for the failure report, and a rank "
              "that stops first gets torchrun's SIGTERM", file=sys.stderr)
        yield None
        return
    workers = ScriptWorkers(StopGroup(codes, step))
    handler_class = _handler_class(workers)
    original = api.get_subprocess_handler

    def handler(*, entrypoint: str, args: tuple, env: dict[str, str], stdout: Any, stderr: Any,
                local_rank_id: int, numa_options: Any = None) -> Any:
        return handler_class(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                             local_rank_id=local_rank_id, numa_options=numa_options)

    api.get_subprocess_handler = handler
    try:
        yield workers
    finally:
        api.get_subprocess_handler = original


def _handler_class(workers: ScriptWorkers):
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    class ScriptHandler(SubprocessHandler):
        """torch's handler: the same Popen (a session of its own, torchrun's environment and output files), its
        stderr tailed when torchrun does not redirect it to a file, its process held (HeldProcess)."""

        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            own = getattr(self, "_stderr", None)
            popen = subprocess.Popen(args=args, env=env, stdout=getattr(self, "_stdout", None),
                                     stderr=own if own is not None else subprocess.PIPE, start_new_session=True)
            if own is None:
                workers.tails[popen.pid] = StderrTail(popen.stderr)
            return HeldProcess(popen, workers.group)

        def close(self, death_sig: signal.Signals | None = None) -> None:
            # torchrun stops the workers: nothing is held from now on, and an ended worker's group is gone
            workers.group.release()
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, death_sig or signal.SIGTERM)
            for stream in (getattr(self, "_stdout", None), getattr(self, "_stderr", None)):
                if stream is not None:
                    stream.close()

    return ScriptHandler
