"""A step with a non-finite gradient (train/skips.py): skipped alike in every step mode, listed in the train record,
and a run that keeps skipping stopped, also across a resume. On the CPU, with the stand-in graph of
test_step_modes.py; the fused optimizer (a GPU's) reads a device flag, the CPU's foreach one is decided on the host."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from hpctrain.errors import UserError, raised_on_every_rank
from hpctrain.experiments.base import BatchInfo
from hpctrain.train import loop, optim, run
from hpctrain.train.skips import SkipLedger, flag_reader
from hpctrain.train.state import TrainState
from hpctrain.train.graphed import GraphedStep
from hpctrain.train.step import EagerStep
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
        build = optim.build_optimizer
        monkeypatch.setattr(optim, "build_optimizer", lambda *a, **k: build(*a, **(k | {"fused": False})))
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


# ---- which path decides: the same on every rank -----------------------------------------------------------------

def test_the_device_flag_path_is_chosen_from_what_every_rank_shares_not_its_own_optimizer_state():
    """Under zero1 a rank may hold no parameters (an empty state): it must take the path the others take, or it
    skips ZeroRedundancyOptimizer.step() (broadcasts from every rank) while they call it (tests/dist/test_nonfinite.py
    runs that case on 2 processes)."""
    holder = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], fused=True)
    holder.param_groups[0]["params"][0].grad = torch.ones(2)
    holder.step()
    assert holder.state  # the rank that holds the parameter
    empty = type("Zero", (), {"optim": torch.optim.AdamW([{"params": []}], fused=True)})()  # the rank that holds none
    assert not empty.optim.state
    for applied in (False, True):
        assert (flag_reader(holder, applied) is holder) == (flag_reader(empty, applied) is empty.optim) == applied
    assert flag_reader(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], foreach=True), True) is None


def _notes(ctx) -> list:
    """What the stepper's ledger is told at each step: a bool (decided on the host) or a device flag."""
    seen: list = []
    note = ctx.stepper.skips.note
    ctx.stepper.skips.note = lambda c, step, skipped: seen.append(skipped) or note(c, step, skipped)
    return seen


def test_fused_sgd_without_momentum_skips_on_the_device_after_the_first_applied_step(tmp_path, monkeypatch, recwarn):
    """SGD with optim.momentum=0 keeps no state at all: the rule cannot hang on the state, or every step would wait
    for the GPU (bool of the norm). The first steps of every launch, a resumed one too, are decided on the host until one
    is applied (fused SGD's first step creates its momentum buffers uninitialised: a skipped one on the device would
    keep them)."""
    ctx = _make(tmp_path, monkeypatch, "eager-fused", "optim.name=sgd", "optim.momentum=0")
    notes = _notes(ctx)
    _nan_noise(monkeypatch, {0, 3})
    _train(ctx, 5)
    assert not ctx.optimizer.state  # nothing in it to decide by
    kinds = [type(n).__name__ for n in notes]
    assert kinds == ["bool", "bool", "Tensor", "Tensor", "Tensor"], kinds  # step 0 skipped, step 1 applied
    assert ctx.state.skipped_at == [1, 4]
    # A resumed launch (a new stepper) decides on the host again until one of its own steps is applied, though the
    # checkpoint's steps were: its first step may make optimizer state the checkpoint has none of (fused SGD's
    # momentum, uninitialised, after optim.momentum was raised from 0), which a skip on the device would leave so.
    ctx.state, ctx.stepper = TrainState.from_dict(ctx.state.to_dict()), EagerStep()
    for group in ctx.optimizer.param_groups:
        group["momentum"] = 0.9  # the resume's config raised optim.momentum from 0 (allowed)
    _nan_noise(monkeypatch, {5})  # and the resumed launch's first step is not finite
    notes = _notes(ctx)
    _train(ctx, 1)
    assert notes == [True] and not ctx.optimizer.state, "the skipped step made (uninitialised) momentum buffers"
    _train(ctx, 1)
    assert notes[1] is False and ctx.optimizer.state  # applied (the buffers made from its gradient) ...
    _train(ctx, 1)
    assert isinstance(notes[2], torch.Tensor)  # ... and the device flag from then on
    # The skipped first steps called no optimizer.step(): torch's warning that the schedule stepped first is wrong.
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


def test_a_graph_is_captured_only_after_a_step_has_been_applied(tmp_path, monkeypatch, caplog):
    """The captured optimizer step needs its state made by an applied eager step (made during the capture, its
    zero-fill would be replayed at every step): warm-up steps that were all skipped are followed by more."""
    ctx = _make(tmp_path, monkeypatch, "graphed")  # two warm-up steps
    eager = _make(tmp_path, monkeypatch, "eager-fused")
    _nan_noise(monkeypatch, {0, 1})
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        g_loss, _ = _train(ctx, 5)
    assert "step captured as a CUDA graph at step 3" in caplog.text  # step 2 ran eagerly and was applied
    e_loss, _ = _train(eager, 5)
    assert g_loss[2:] == pytest.approx(e_loss[2:], rel=1e-5) and ctx.state.skipped_at == eager.state.skipped_at
    for a, b in zip(_weights(ctx), _weights(eager)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ---- the EMA of a skipped step ------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", [True, torch.tensor(1.0)], ids=["host", "device"])
def test_a_skipped_step_keeps_the_emas_batch_norm_statistics_on_the_device_path_too(flag):
    """The skipped step's forward made the model's running statistics NaN; weighting them by 0 would still give NaN
    (0 x NaN), so the device flag selects the EMA's own values, as the host path does by not updating."""
    from hpctrain.train.ema import EMA, ema_step, ema_update

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    ema = EMA(model, 0.9)
    ema.update_parameters(model)  # the first update (a copy)
    model(torch.randn(4, 2))
    ema.update_parameters(model)  # an applied step
    kept = [t.clone() for t in ema.module.state_dict().values()]
    model(torch.full((4, 2), math.nan))  # the skipped step's forward
    assert model[1].running_mean.isnan().all()
    ema_step(ema, model, flag)
    assert all(torch.equal(a, b) for a, b in zip(ema.module.state_dict().values(), kept)), "the EMA changed"
    assert int(ema.n_averaged) == 3
    ema_update(ema, model, torch.tensor(0.1), torch.tensor(1.0))  # the graph's body, with its tensor weight
    assert all(torch.equal(a, b) for a, b in zip(ema.module.state_dict().values(), kept))
    # An applied step takes them in as the model has them (the README says so).
    ema_update(ema, model, torch.tensor(0.1), torch.tensor(0.0))
    assert ema.module[1].running_mean.isnan().all() and not ema.module[0].weight.isnan().any()


class _Buffers(torch.nn.Module):
    """Buffers of every kind the batched update groups: 1-D, 0-d (float and integer), 2-D, half precision, and a
    transposed (non-contiguous) one, which goes on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.randn(()))
        self.register_buffer("table", torch.randn(3, 4))
        self.register_buffer("odd", torch.randn(4, 3).t())
        self.register_buffer("low", torch.randn(5).half())
        self.register_buffer("count", torch.tensor(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _bn_model(blocks: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[m for _ in range(blocks) for m in (torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))],
                               _Buffers())


def _ema_update_tensor_by_tensor(ema, model, weight, skipped) -> None:
    """The update as it was (one tensor at a time), the reference the batched one must equal bit for bit."""
    if skipped is not None:
        weight = weight * (1 - skipped)
    keep = None if skipped is None else skipped.bool()
    params = list(zip(ema.module.parameters(), model.parameters()))
    with torch.no_grad():
        for a, b in params:  # the parameters without a select (a skipped step left the model's as they were)
            a.add_((b - a) * weight)
        for a, b in zip(ema.module.buffers(), model.buffers()):
            new = a + (b - a) * weight if a.is_floating_point() else a * (1 - weight) + b * weight
            a.copy_(new if keep is None else torch.where(keep, a, new))


@pytest.mark.parametrize("skipped", [None, 0.0, 1.0], ids=["no-flag", "applied", "skipped"])
def test_the_batched_ema_update_of_the_buffers_equals_the_update_tensor_by_tensor_bit_for_bit(skipped):
    from hpctrain.train.ema import EMA, ema_update

    torch.manual_seed(0)
    model = _bn_model(3)
    emas = [EMA(model, 0.9) for _ in range(2)]
    for ema in emas:
        ema.update_parameters(model)  # the first update: a copy
    model(torch.randn(8, 4))  # running statistics move, num_batches_tracked counts
    with torch.no_grad():
        for t in model[-1].buffers():
            t.copy_(t * 3 + 1)
        model[1].running_mean[1] = math.nan  # a NaN statistic: kept on a skipped step, taken in on an applied one
    flag = None if skipped is None else torch.tensor(skipped)
    for _ in range(3):
        ema_update(emas[0], model, torch.tensor(0.3), flag)
        _ema_update_tensor_by_tensor(emas[1], model, torch.tensor(0.3), flag)
    got, want = emas[0].module.state_dict(), emas[1].module.state_dict()
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(got[name].nan_to_num(), want[name].nan_to_num()), f"{name}: {got[name]} != {want[name]}"
        assert torch.equal(got[name].isnan(), want[name].isnan()), name
    assert not emas[0].module[-1].odd.is_contiguous()  # written through the transposed buffer itself
    changed = not torch.equal(got["6.count"], torch.tensor(7))
    assert changed == (skipped != 1.0) and bool(got["1.running_mean"][1].isnan()) == (skipped != 1.0)


def test_the_ema_update_of_a_batch_norm_model_costs_the_same_few_operations_however_many_layers():
    """A fused optimizer's EMA update runs at every step (a graph replays its kernels): the buffers go as a few flat
    tensors per dtype (cat/stack, the update, the select, one copy back through views), not five operations each."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hpctrain.train.ema import EMA, ema_update

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    counts = {}
    for blocks in (2, 53):
        model = _bn_model(blocks)[:-1]
        ema = EMA(model, 0.9)
        ema.update_parameters(model)
        weight, flag = torch.tensor(0.1), torch.tensor(0.0)
        with Count() as count:
            ema_update(ema, model, weight, flag)
        counts[blocks] = len(count.ops)
        # Captured in a CUDA graph: no host read of a value, no shape that depends on one.
        assert not {"aten._local_scalar_dense.default", "aten.nonzero.default"} & set(count.ops), count.ops
    assert counts[53] == counts[2] <= 30, f"operations of one EMA update with 2 and 53 BatchNorm layers: {counts}"


# ---- fp16: GradScaler's backoffs ------------------------------------------------------------------------------------

def test_an_fp16_loss_scale_backoff_is_logged_as_such_and_stops_nothing_until_the_scale_falls_below_1(
        tmp_path, monkeypatch, caplog):
    """GradScaler skips a step and halves its scale whenever the scaled gradient overflows (several times at the
    start, then about once per growth interval): that is loss scaling, not divergence. Listed as skipped, logged at
    INFO; the run stops only once the scale has fallen below 1 and the count in a row is past the limit."""
    ctx = _make(tmp_path, monkeypatch, "eager-fused", "train.max_skipped_steps=0")
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)  # fp16's scaler (a CPU one here: the same scale logic)
    scaler.scale(torch.ones(()))  # its scale is made at the first scale()
    ctx.scaler = scaler
    ledger = SkipLedger()
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        for step, scale in ((1, 2.0), (2, 1.0)):  # two backoffs in a row, a limit of 0
            scaler.update(scale)
            ledger.note(ctx, step, True)
    assert ctx.state.skipped_at == [1, 2] and ctx.state.skipped_in_a_row == 2
    assert "step 2 skipped: fp16 loss-scale backoff (the scaled gradient overflowed), loss scale now 1" in caplog.text
    assert "WARNING" not in caplog.text
    scaler.update(0.5)  # the gradient overflows fp16 even unscaled, or is NaN whatever the scale: divergence
    with pytest.raises(UserError, match=r"3 optimizer steps in a row \(steps 1-3\)"):
        ledger.note(ctx, 3, True)
    assert "step 3 skipped: the gradient is not finite" in caplog.text
    ledger.note(ctx, 4, False)
    assert ctx.state.skipped_in_a_row == 0
