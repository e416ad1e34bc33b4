"""A step with a non-finite gradient (train/skips.py): skipped alike in every step mode, listed in the train record,
and a run that keeps skipping stopped, also across a resume. On the CPU, with the stand-in graph of
test_step_modes.py; the fused optimizer (a GPU's) reads a device flag, the CPU's foreach one is decided on the host."""

from __future__ import annotations

import math

import pytest
import torch

from hpctrain.errors import UserError, raised_on_every_rank
from hpctrain.experiments.base import BatchInfo
from hpctrain.train import loop, run
from hpctrain.train.skips import SkipLedger
from hpctrain.train.state import TrainState
from hpctrain.train.step import EagerStep, GraphedStep
from tests.unit.test_step_modes import _context, _train, _weights, host_replay


def _nan_noise(monkeypatch, steps: set[int]) -> None:
    """The diffusion noise of these steps (0-based, as BatchInfo.step) is NaN: so are their losses and gradients."""
    randn = BatchInfo.randn
    monkeypatch.setattr(BatchInfo, "randn",
                        lambda self, *a, **k: randn(self, *a, **k) * (math.nan if self.step in steps else 1))


def _make(tmp_path, monkeypatch, mode: str, *extra: str):
    """eager-fused: the GPU's optimizer (a device flag skips it); eager-foreach: the CPU's (the host decides);
    graphed: the captured step, replayed by the stand-in."""
    if mode == "eager-foreach":
        build = run.build_optimizer
        monkeypatch.setattr(run, "build_optimizer", lambda *a, **k: build(*a, **(k | {"fused": False})))
    ctx = _context(tmp_path / mode, monkeypatch, *extra)
    if mode == "graphed":
        ctx.stepper = GraphedStep(warmup=2, graph_class=host_replay(ctx))
    return ctx


def _optimizer_state(ctx) -> list[torch.Tensor]:
    return [v.clone() for s in ctx.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


class Recorder:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, record: dict) -> None:
        self.records.append(record)


def _record(ctx) -> dict:
    ctx.metrics = Recorder()
    window = loop._Window(ctx.state.step)
    window.add(torch.tensor(1.0), None)
    loop.log_train(ctx, window)
    return ctx.metrics.records[-1]


@pytest.mark.parametrize("mode", ["eager-fused", "eager-foreach", "graphed"])
def test_a_non_finite_step_changes_no_weight_state_or_ema_in_every_mode(tmp_path, monkeypatch, mode):
    ctx = _make(tmp_path, monkeypatch, mode)
    _train(ctx, 3)  # graphed: two eager warm-up steps, then the capture
    weights, state, averaged, lr_steps = _weights(ctx), _optimizer_state(ctx), int(ctx.ema.n_averaged), \
        ctx.scheduler.last_epoch
    _nan_noise(monkeypatch, {3})
    losses, _ = _train(ctx, 1)
    assert math.isnan(losses[0])
    assert all(torch.equal(a, b) for a, b in zip(_weights(ctx), weights, strict=True)), "a weight or the EMA moved"
    assert all(torch.equal(a, b) for a, b in zip(_optimizer_state(ctx), state, strict=True)), "AdamW's state moved"
    # Still a step: the schedule and the EMA's count move on, as in a graph (which cannot branch on the host).
    assert (int(ctx.ema.n_averaged), ctx.scheduler.last_epoch) == (averaged + 1, lr_steps + 1)
    assert (ctx.state.skipped_at, ctx.state.skipped_in_a_row) == ([4], 1)
    after, _ = _train(ctx, 2)
    assert all(map(math.isfinite, after)) and ctx.state.skipped_in_a_row == 0
    assert all(t.isfinite().all() for t in _weights(ctx)) and not torch.equal(_weights(ctx)[0], weights[0])
    record = _record(ctx)
    assert (record["skipped_steps"], record["skipped_at"]) == (1, [4])
    assert "skipped_steps" not in _record(ctx)  # listed once, in the record of its window


def test_eager_and_graphed_train_alike_through_a_skipped_step(tmp_path, monkeypatch):
    """A graphed launch's first steps are eager: one rule, so a resumed graphed run trains as an uninterrupted one."""
    eager, graphed = _make(tmp_path, monkeypatch, "eager-fused"), _make(tmp_path, monkeypatch, "graphed")
    _nan_noise(monkeypatch, {1, 4})  # one in the graphed run's warm-up, one replayed
    e_loss, _ = _train(eager, 6)
    g_loss, _ = _train(graphed, 6)
    assert [math.isnan(x) for x in e_loss] == [math.isnan(x) for x in g_loss] == [i in (1, 4) for i in range(6)]
    assert [x for x in g_loss if math.isfinite(x)] == pytest.approx([x for x in e_loss if math.isfinite(x)], rel=1e-5)
    for a, b in zip(_weights(graphed), _weights(eager)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert graphed.state.skipped_at == eager.state.skipped_at == [2, 5]


def test_a_run_that_keeps_skipping_stops_and_a_resume_continues_the_count(tmp_path, monkeypatch):
    ctx = _make(tmp_path, monkeypatch, "eager-fused", "train.max_skipped_steps=2")
    _nan_noise(monkeypatch, set(range(3, 100)))
    _train(ctx, 5)  # steps 4 and 5 skipped: at the limit, not past it
    assert ctx.state.skipped_in_a_row == 2
    # A checkpoint here, and a new launch: its state from the checkpoint's state.json, a new stepper.
    ctx.state = TrainState.from_dict(ctx.state.to_dict())
    ctx.stepper = EagerStep()
    with pytest.raises(UserError) as err:
        _train(ctx, 1)
    assert "3 optimizer steps in a row (steps 4-6) had a non-finite gradient" in str(err.value)
    assert "train.max_skipped_steps=2" in str(err.value) and "optim.lr" in err.value.hint
    assert raised_on_every_rank(err.value)  # the same flags on every rank: all stop at this step together


class Deferred(SkipLedger):
    """The ledger as on a GPU: each flag copied to the host and read LAG steps later (here a CPU clone and an event
    that is always done)."""

    def _later(self, flag: torch.Tensor) -> bool:
        return True

    def _copy(self, flag: torch.Tensor):
        return flag.clone(), type("Done", (), {"synchronize": lambda self: None})()


def test_device_flags_are_read_two_steps_late_and_all_before_a_record_or_checkpoint(tmp_path, monkeypatch):
    ctx = _make(tmp_path, monkeypatch, "eager-fused", "train.max_skipped_steps=1")
    ledger = Deferred()
    for step, flag in ((1, 1.0), (2, 0.0), (3, 1.0)):
        ledger.note(ctx, step, torch.tensor(flag))
    assert ctx.state.skipped_at == [1] and len(ledger.pending) == 2  # step 1 read at step 3
    ledger.settle(ctx)
    assert ctx.state.skipped_at == [1, 3] and ctx.state.skipped_in_a_row == 1 and not ledger.pending
    ledger.note(ctx, 4, torch.tensor(1.0))
    ledger.note(ctx, 5, torch.tensor(0.0))
    with pytest.raises(UserError, match=r"2 optimizer steps in a row \(steps 3-4\)"):
        ledger.settle(ctx)


def test_a_negative_limit_is_refused_with_what_it_means():
    from tests.unit.test_step_modes import _cfg

    with pytest.raises(UserError, match=r"train.max_skipped_steps.*must be >= 0 \(0: stop at the first step skipped"):
        _cfg("train.max_skipped_steps=-1")
    assert _cfg().train.max_skipped_steps == 20 and _cfg("train.max_skipped_steps=0").train.max_skipped_steps == 0
