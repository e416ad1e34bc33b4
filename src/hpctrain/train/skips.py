"""Steps skipped for a non-finite gradient: the one rule of every step mode (eager, compiled, graphed), and the
ledger that logs them and stops a run that keeps skipping.

The rule: a step whose global gradient norm is not finite (an inf or NaN in any gradient of any rank) changes
nothing: not the weights, the optimizer's state (moments, step count) or the EMA's weights. It is still a step: its
batch is consumed, the schedule and the EMA's update count move on. That is what GradScaler does with fp16 and what
a captured graph must do (it cannot branch on the host); every graphed launch's eager warm-up follows it too, so a
resumed graphed run trains as an uninterrupted one.

Every rank decides alike without a collective of its own: the norm is of the all-reduced gradients (DDP, ZeRO-1) or
reduced over the shards (FSDP), as for clipping. Where the optimizer reads a device flag (torch's fused AdamW and SGD:
``found_inf``) the step is skipped on the device and the host reads the flag two steps late, from the first applied
step of each launch on (flag_reader says why); elsewhere the host reads it at once and does not call step(). Which
of the two is decided alike on every rank, so under zero1 either every rank calls step() or none does.
"""

from __future__ import annotations

import collections
import logging

import torch

from hpctrain.errors import UserError, agreed_on_every_rank

log = logging.getLogger("hpctrain")

LOSS_SCALE_FLOOR = 1.0
"""Under fp16, a skipped step whose GradScaler loss scale is still at or above this after its backoff is loss
scaling at work (the scaled gradient overflowed; GradScaler halves the scale and goes on: several times at the start,
then about once per growth interval): logged at INFO, and no stop for train.max_skipped_steps while the scale is
there (the skips still count in a row). Below it the gradient overflows fp16 even unscaled, or is NaN whatever the
scale (each skip halves it: from GradScaler's 2**16, the 17th skip in a row goes below 1): a warning, and the limit
stops the run."""

LAG = 2
"""Steps between a device flag's step and its read on the host: the GPU has finished that step by then (the graphed
step's MAX_AHEAD), so the read waits for nothing the host could otherwise queue."""


def flag_reader(optimizer: torch.optim.Optimizer, applied: bool) -> torch.optim.Optimizer | None:
    """The optimizer that skips its own update on a device flag (``found_inf``), or None where the host must decide.

    Decided from facts that are the same on every rank, never from this rank's own optimizer state: under zero1 a
    rank may hold no parameters (more ranks than parameter tensors) and keeps an empty state, and a rank on the host
    path skips a step by not calling ZeroRedundancyOptimizer.step(), whose parameter broadcasts the other ranks would
    then wait for. So: the optimizer class takes ``found_inf`` and every group is fused (torch's fused AdamW and SGD;
    ZeRO-1 steps its partition with its inner optimizer, one with no parameters ignores the flag and still
    broadcasts), and ``applied``: a step of this launch has updated the weights (EagerStep.applied). Before that,
    the host decides: torch's fused SGD creates its momentum buffers uninitialised on its first step and a skipped
    first step would keep them (after a resume too, for parameters the checkpoint holds no momentum of), and a fused
    SGD without momentum never creates any state at all."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own optimizer
    fused = getattr(inner, "_step_supports_amp_scaling", False) and all(g.get("fused") for g in inner.param_groups)
    return inner if fused and applied else None


def not_finite(norm: torch.Tensor) -> torch.Tensor:
    """1.0 where the gradient norm is inf or NaN, else 0.0 (float32: the fused optimizers' found_inf)."""
    return (~torch.isfinite(norm)).float()


class SkipLedger:
    """The steps skipped, read on the host: logged, listed for the train record and limited (train.max_skipped_steps
    in a row). Both the list and the count in a row are in TrainState: a checkpoint holds them, and a resumed run
    goes on with them."""

    def __init__(self) -> None:
        self.pending: collections.deque = collections.deque()
        """(step, pinned host copy of the device flag, event after the copy), oldest first."""

    def note(self, ctx, step: int, skipped: torch.Tensor | bool) -> None:
        """Step ``step`` (numbered as the records: steps done after it) was skipped: a host bool, or a device flag."""
        if isinstance(skipped, bool) or not self._later(skipped):
            self._count(ctx, step, bool(skipped))
            return
        self.pending.append((step, *self._copy(skipped)))
        while len(self.pending) > LAG:
            self._read_oldest(ctx)

    def _later(self, flag: torch.Tensor) -> bool:
        """A flag on a GPU is read later; on the CPU the value is there, and reading it waits for nothing."""
        return flag.device.type == "cuda"

    def _copy(self, flag: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The flag copied to pinned host memory behind the step's work, and an event that says when it is there."""
        host = torch.empty((), dtype=flag.dtype, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def settle(self, ctx) -> None:
        """Read every pending flag: before a checkpoint (its counts are then exact) and a train record."""
        while self.pending:
            self._read_oldest(ctx)

    def _read_oldest(self, ctx) -> None:
        step, host, done = self.pending.popleft()
        done.synchronize()
        self._count(ctx, step, bool(host))

    def _count(self, ctx, step: int, skipped: bool) -> None:
        state = ctx.state
        if not skipped:
            state.skipped_in_a_row = 0
            return
        state.skipped_at.append(step)
        state.skipped_in_a_row += 1
        scale = loss_scale(ctx)
        if scale is not None and scale >= LOSS_SCALE_FLOOR:  # GradScaler at work: never a stop
            if ctx.runtime.is_main:
                log.info("step %d skipped: fp16 loss-scale backoff (the scaled gradient overflowed), loss scale now "
                         "%g", step, scale)
            return
        if ctx.runtime.is_main:
            log.warning("step %d skipped: the gradient is not finite (inf or NaN); weights, optimizer state and EMA "
                        "unchanged (%d in a row)", step, state.skipped_in_a_row)
        limit = ctx.cfg.train.max_skipped_steps
        if state.skipped_in_a_row > limit:
            raise too_many(state.skipped_in_a_row, step, limit)


def loss_scale(ctx) -> float | None:
    """GradScaler's loss scale under fp16 (None without loss scaling). Read only for a skipped step, when the host
    reads its flag: get_scale() waits for the GPU, rare enough there. Read up to two steps late (a device flag), it
    may include those steps' backoffs (they were skipped too) or a growth."""
    scaler = getattr(ctx, "scaler", None)
    return scaler.get_scale() if scaler is not None and scaler.is_enabled() else None


def too_many(in_a_row: int, step: int, limit: int) -> UserError:
    """Every rank reads the same flags at the same step: every rank raises this there."""
    first = step - in_a_row + 1
    return agreed_on_every_rank(UserError(
        f"{in_a_row} optimizer steps in a row (steps {first}-{step}) had a non-finite gradient (inf or NaN) and were "
        f"skipped, more than train.max_skipped_steps={limit}: the run has diverged or its data holds inf/NaN. The "
        f"weights have not changed since step {first - 1}; checkpoints saved since then hold them",
        f"start again, or resume from a checkpoint saved before step {first} (ckpt.resume=RUN_DIR/checkpoints/step_...), "
        "with a lower optim.lr, train.grad_clip > 0, or train.precision=bf16/fp32 instead of fp16; check the data for inf/NaN "
        "(the train records' loss shows where it began); or raise train.max_skipped_steps if such runs of skips are "
        "expected."))


def settle_skips(ctx) -> None:
    """Read the flags of the steps taken so far into the train state (a stepper without a ledger has none)."""
    ledger = getattr(ctx.stepper, "skips", None)
    if ledger is not None:
        ledger.settle(ctx)


def skip_fields(ctx) -> dict[str, int | list[int]]:
    """The train record's skipped_steps (how many since the last record) and skipped_at (which), when any."""
    settle_skips(ctx)
    steps = getattr(ctx.state, "skipped_at", None)  # None: a stand-in state (the loop's unit tests)
    if not steps:
        return {}
    ctx.state.skipped_at = []
    return {"skipped_steps": len(steps), "skipped_at": steps}
