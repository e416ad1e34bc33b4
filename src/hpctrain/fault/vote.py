"""The step-boundary vote: every rank contributes flags, all ranks act on the MAX together.

A signal reaches one rank, or ranks at different moments; if only that rank
stopped, the others would wait in the next collective until the timeout. So at
every optimizer-step boundary each rank casts (stop signal number, checkpoint due)
and all ranks act on the all-reduced MAX, at the same step.

The all-reduce is asynchronous: cast at boundary k, collected at boundary k+1,
so its latency hides behind a step of compute instead of adding to every step.
A stop therefore lands one step later than the signal, on every rank alike.
"""

from __future__ import annotations

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
        # gloo reduces CPU tensors, nccl device tensors.
        self._device = runtime.device if runtime.backend == "nccl" else torch.device("cpu")

    def cast(self, stop_signal: int, save_due: bool) -> None:
        flags = torch.tensor([float(stop_signal), float(save_due)], device=self._device)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True) if self.runtime.distributed else None
        self._pending = (flags, work)

    def collect(self) -> Verdict:
        """The verdict of the vote cast at the previous boundary (NOTHING if none is pending)."""
        if self._pending is None:
            return NOTHING
        flags, work = self._pending
        self._pending = None
        if work is not None:
            work.wait()  # type: ignore[attr-defined]
        stop, due = flags.tolist()
        return Verdict(int(stop), bool(due))
