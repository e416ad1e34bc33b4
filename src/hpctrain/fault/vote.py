"""The step-boundary vote: every rank contributes flags, all ranks act on the MAX together.

A signal reaches one rank, or ranks at different moments; if only that rank stopped, the others would wait in the
next collective until the timeout. So at every optimizer-step boundary each rank casts (stop signal number,
checkpoint due, run dir lock lost) and all ranks act on the all-reduced MAX, at the same step. The lock is rank 0's
(fault/run_lock.py): when its heartbeat thread finds it taken over, every rank stops with an error at the next
boundary.

The all-reduce is asynchronous: cast at boundary k, collected at boundary k+1, so its latency hides behind a step
of compute instead of adding to every step, and a stop lands one step later than the signal, on every rank alike.
Neither side of it waits for the GPU to finish the step just queued (StepVote says how, on NCCL and on gloo).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpctrain.dist.runtime import Runtime


@dataclass(frozen=True)
class Verdict:
    stop_signal: int
    """Largest stop signal number seen by any rank (0: none)."""
    save_due: bool
    """The time-based checkpoint interval has passed (rank 0's clock)."""
    lock_lost: bool = False
    """Rank 0's run dir lock is no longer its own: another training may write the run dir."""


NOTHING = Verdict(0, False)


class StepVote:
    """Flags built from pageable host memory and read back with .tolist() right away (the first version) are a
    host-to-device copy that waits for the stream and a device synchronisation each step, so the host cannot queue
    step k+1 while the GPU runs step k. Instead, on NCCL: the flags go up from pinned memory (non-blocking), are
    reduced on the training group, come back into pinned memory (non-blocking), and an event marks the copy.
    collect() waits for that event: the GPU has then finished step k's work, while step k+1's is already queued.
    NCCL reduces 8 bytes in microseconds at any scale (tree); its watchdog bounds the wait by dist.timeout_s. On
    gloo (CPU runs): CPU tensors on the training group, reduced in gloo's own threads; a peer that has not arrived
    within dist.timeout_s is lost, as in any training collective. (Not on the control group: its longer timeout
    would also be the time a rank that gave up on the vote waits for the pending reduction at teardown.)"""
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._pending: tuple[torch.Tensor, object] | None = None
        self._on_gpu = runtime.backend == "nccl"
        self.run_lock = None
        """Rank 0's RunLock (fault/run_lock.py), whose ``lost`` this rank casts; None on the other ranks."""
        self._polled = 0
        """A stop the ranks agreed on between two boundaries (poll): the next collect() says it too."""

    def cast(self, stop_signal: int, save_due: bool) -> None:
        lost = self.run_lock is not None and bool(self.run_lock.lost)
        flags = torch.tensor([_priority(stop_signal), float(save_due), float(lost)])
        if not self.runtime.distributed:
            self._pending = (flags, None)
        elif self._on_gpu:
            self._pending = self._cast_on_gpu(flags)
        else:
            self._pending = (flags, dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True))

    def _cast_on_gpu(self, flags: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        # Pinned host memory from torch's caching host allocator, which keeps a block until its copy is done.
        on_device = flags.pin_memory().to(self.runtime.device, non_blocking=True)
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX, async_op=True).wait()  # the stream waits, not the host
        back = torch.empty(3, pin_memory=True)
        back.copy_(on_device, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return back, done

    def poll(self, stop_signal: int) -> int:
        """Collective, and synchronous: the stop signal any rank has received by now (0: none), agreed at once, for a
        loop that needs the answer before its next boundary (a long inner loop, a validation pass). The next
        boundary acts on it, whatever its own vote says."""
        flags = torch.tensor([_priority(stop_signal)], device=self.runtime.device if self._on_gpu else "cpu")
        if self.runtime.distributed:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        agreed = _signal(flags.item())
        self._polled = _stronger(self._polled, agreed)
        return agreed

    def collect(self) -> Verdict:
        """The verdict of the vote cast at the previous boundary (NOTHING if none is pending), with a stop agreed by
        poll() since then."""
        verdict = self._collect()
        if self._polled:
            verdict = Verdict(_stronger(verdict.stop_signal, self._polled), verdict.save_due, verdict.lock_lost)
            self._polled = 0
        return verdict

    def _collect(self) -> Verdict:
        if self._pending is None:
            return NOTHING
        flags, waitable = self._pending
        self._pending = None
        if isinstance(waitable, torch.cuda.Event):
            waitable.synchronize()  # the previous step's GPU work and the reduction: not the step just queued
        elif waitable is not None:
            waitable.wait()  # type: ignore[attr-defined]  # gloo: the training group's timeout applies
        stop, due, lost = flags.tolist()
        return Verdict(_signal(stop), bool(due), bool(lost))


CTRL_C = 0.5
"""SIGINT's value in the MAX vote: below every other stop signal, so that when one rank was interrupted by the user
and another preempted by the cluster (SIGTERM, SIGHUP, the warning signal), all act on the cluster's stop."""


def _priority(stop_signal: int) -> float:
    return CTRL_C if stop_signal == signal.SIGINT else float(stop_signal)


def _signal(priority: float) -> int:
    return signal.SIGINT if priority == CTRL_C else int(priority)


def _stronger(a: int, b: int) -> int:
    """The stop the vote's MAX would pick of two."""
    return a if _priority(a) >= _priority(b) else b
