"""The step-boundary vote: every rank contributes flags, all ranks act on the MAX together.

A signal reaches one rank, or ranks at different moments; if only that rank
stopped, the others would wait in the next collective until the timeout. So at
every optimizer-step boundary each rank casts (stop signal number, checkpoint due)
and all ranks act on the all-reduced MAX, at the same step.

The all-reduce is asynchronous: cast at boundary k, collected at boundary k+1,
so its latency hides behind a step of compute instead of adding to every step.
A stop therefore lands one step later than the signal, on every rank alike.

It runs on the control plane (a gloo group, CPU tensors), not on NCCL: flags built from host memory and read
back with .tolist() would be a host-to-device copy and a device synchronisation each step, the host waiting
for every queued kernel before it could launch the next step's. On gloo the reduction runs in gloo's own
threads and never touches the GPU. It waits at most dist.timeout_s (not the control plane's longer limit):
ranks meet here every step, and a peer that has not arrived by then is lost, as in any training collective.
"""

from __future__ import annotations

import datetime
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


NOTHING = Verdict(0, False)


class StepVote:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._pending: tuple[torch.Tensor, object] | None = None
        self._timeout = datetime.timedelta(seconds=runtime.timeout_s)

    def cast(self, stop_signal: int, save_due: bool) -> None:
        flags = torch.tensor([float(stop_signal), float(save_due)])
        work = None
        if self.runtime.distributed:
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.runtime.control, async_op=True)
        self._pending = (flags, work)

    def collect(self) -> Verdict:
        """The verdict of the vote cast at the previous boundary (NOTHING if none is pending)."""
        if self._pending is None:
            return NOTHING
        flags, work = self._pending
        self._pending = None
        if work is not None:
            try:
                work.wait(self._timeout)  # type: ignore[attr-defined]
            except RuntimeError as err:
                raise RuntimeError(
                    f"the step-boundary vote: not every rank arrived within dist.timeout_s={self.runtime.timeout_s:g} s "
                    f"({err}); a peer is stuck or gone (see its log and the hang report)"
                ) from err
        stop, due = flags.tolist()
        return Verdict(int(stop), bool(due))
