"""train.step_mode (train/step_mode.py, step.py, graphed.py): the choice, its refusals, and the graphed step's arithmetic checked on the CPU.

A real capture needs a GPU (tests/gpu/test_step_graphed.py). Here a stand-in graph runs the captured body in
Python at every replay, with everything a real capture leaves untouched restored after its capture run: that checks
what the graphed step does differently from the eager one (batches copied into static slots, draws refilled into
static buffers, learning rates from device tensors, the non-finite skip, the EMA with a tensor weight, gradients
written rather than accumulated) against the eager step, step by step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

from hpctrain.config.schema import RunConfig
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.errors import UserError
from hpctrain.experiments.base import BatchInfo
from hpctrain.resolution import resolve_config
from hpctrain.train import loop
from hpctrain.train.precision import Precision
from hpctrain.train.graphed import CaptureError, GraphedStep, StaticDraws
from hpctrain.train.step import EagerStep, RecordingInfo
from hpctrain.train.step_mode import StepChoice, choose_step_mode, graph_refusal

TINY = ("model.source=fixture", "model.fixture_samples=256", "model.image_size=16", "model.ch=16",
        "model.ch_mult=[1, 2]", "model.num_res_blocks=1", "model.attn_resolutions=[8]", "model.norm_groups=8",
        "model.dropout=0.1", "data.on_device=true", "data.num_workers=0", "train.precision=fp32",
        "train.global_batch_size=16", "train.micro_batch_size=8", "train.max_steps=100", "optim.warmup_steps=4",
        "optim.ema_decay=0.9", "train.grad_clip=0.5", "log.progress=off", "log.tensorboard=false")


# ---- the choice ----------------------------------------------------------------------------------------------

def _cfg(*overrides: str) -> RunConfig:
    return resolve_config("ddpm_cifar10", None, overrides)[1]


def _runtime(device: str, world: int = 1, backend: str = "nccl"):
    rt = single_process_runtime(torch.device("cpu"))
    return dataclasses.replace(rt, device=torch.device(device), world_size=world, backend=backend if world > 1 else "")


BF16 = Precision("bf16", torch.bfloat16, "cuda")


def test_auto_runs_eagerly_on_the_cpu_and_says_why():
    choice = choose_step_mode(_cfg(), _runtime("cpu"), Precision("fp32", None, "cpu"))
    assert choice == StepChoice("eager", "auto: not graphed, CUDA graphs need a GPU and this run is on the CPU")
    compiled = choose_step_mode(_cfg("train.compile=true"), _runtime("cpu"), Precision("fp32", None, "cpu"))
    assert compiled.mode == "compiled"


def test_graphed_asked_for_where_it_cannot_run_is_an_error_that_says_what_to_do():
    with pytest.raises(UserError) as err:
        choose_step_mode(_cfg("train.step_mode=graphed"), _runtime("cpu"), Precision("fp32", None, "cpu"))
    assert "train.step_mode=graphed: CUDA graphs need a GPU" in str(err.value)
    assert "train.step_mode=auto" in err.value.hint


def test_auto_on_a_gpu_graphs_one_process_and_leaves_multi_gpu_capture_opt_in():
    # with accumulation too (the context's plan, not asked here): its GPU test passed (tests/gpu/test_step_graphed.py)
    assert choose_step_mode(_cfg(), _runtime("cuda:0"), BF16).mode == "graphed"
    many = choose_step_mode(_cfg(), _runtime("cuda:0", world=2), BF16)
    assert many.mode == "eager" and "opt-in" in many.reason
    assert choose_step_mode(_cfg("train.step_mode=graphed"), _runtime("cuda:0", world=2), BF16).mode == "graphed"


def test_an_optimizer_of_the_experiments_own_runs_eagerly_on_a_gpu_and_graphed_is_refused():
    """Issue 40, section 1: a captured step needs hpctrain's fused AdamW or SGD (tensor rates, the device skip)."""
    own = choose_step_mode(_cfg(), _runtime("cuda:0"), BF16, own_optimizer=True)
    assert own.mode == "eager" and "builds its own optimizer (build_optimizer)" in own.reason
    with pytest.raises(UserError, match="train.step_mode=graphed: the experiment builds its own optimizer"):
        choose_step_mode(_cfg("train.step_mode=graphed"), _runtime("cuda:0"), BF16, own_optimizer=True)


def test_cudnn_benchmark_is_on_for_a_graphed_step_on_a_gpu_and_said_in_the_start_up_line():
    graphed = choose_step_mode(_cfg(), _runtime("cuda:0"), BF16)
    assert graphed.cudnn_benchmark and graphed.describe() == "graphed (auto: one process on CUDA), cudnn.benchmark on"
    eager = choose_step_mode(_cfg("train.step_mode=eager"), _runtime("cuda:0"), BF16)
    assert not eager.cudnn_benchmark and eager.describe() == "eager (asked for (train.step_mode=eager))"
    assert choose_step_mode(_cfg("train.step_mode=eager", "train.cudnn_benchmark=on"), _runtime("cuda:0"),
                            BF16).cudnn_benchmark
    assert not choose_step_mode(_cfg("train.cudnn_benchmark=off"), _runtime("cuda:0"), BF16).cudnn_benchmark
    cpu = choose_step_mode(_cfg("train.cudnn_benchmark=on"), _runtime("cpu"), Precision("fp32", None, "cpu"))
    assert not cpu.cudnn_benchmark  # nothing to set on a CPU
    # Only auto's choice for the graph is undone by an eager fallback; one the user asked for stays.
    assert graphed.cudnn_for_graph
    assert not choose_step_mode(_cfg("train.cudnn_benchmark=on"), _runtime("cuda:0"), BF16).cudnn_for_graph


@pytest.mark.parametrize("overrides, runtime, precision, words", [
    ((), ("cuda:0",), Precision("fp16", torch.float16, "cuda"), "GradScaler"),
    (("dist.strategy=fsdp",), ("cuda:0", 2), BF16, "dist.strategy=fsdp"),
    (("dist.strategy=zero1",), ("cuda:0", 2), BF16, "dist.strategy=zero1"),
    ((), ("cuda:0", 2, "gloo"), BF16, "gloo backend"),
])
def test_what_cannot_be_captured_is_named(overrides, runtime, precision, words):
    assert words in graph_refusal(_cfg(*overrides), _runtime(*runtime), precision)
    assert "graphable=False" in graph_refusal(_cfg(), _runtime("cuda:0"), BF16, graphable=False)


def test_compile_with_eager_is_a_contradiction_the_config_refuses():
    with pytest.raises(UserError, match="train.step_mode"):
        _cfg("train.compile=true", "train.step_mode=eager")
    assert _cfg("train.step_mode=compiled").train.compiled


# ---- static draws --------------------------------------------------------------------------------------------

def test_static_draws_are_the_warm_up_steps_draws_made_before_the_capture():
    recording = RecordingInfo(BatchInfo("train", 3, 8, 16, 0))
    noise, t = recording.randn(8, 3, stream=1), recording.randint(10, 8, stream=0)
    assert recording.step == 3  # an eager step may read the info
    draws = StaticDraws(torch.device("cpu"), recording.draws)
    buffers = [d[3] for d in draws.draws]  # made here, before any capture (not in the graph's reused memory)
    assert [b.shape for b in buffers] == [noise.shape, t.shape] and buffers[1].dtype == torch.int64
    draws.refill(BatchInfo("train", 3, 8, 16, 0))
    assert torch.equal(draws.randn(8, 3, stream=1, device="cpu"), noise)
    assert draws.randint(10, 8, stream=0, device="cpu") is buffers[1]
    draws.refill(BatchInfo("train", 4, 8, 16, 0))  # the next step: new numbers in the same buffers
    assert draws.randn(8, 3, stream=1, device="cpu") is buffers[0] and not torch.equal(buffers[0], noise)
    with pytest.raises(CaptureError, match="is not the draw the eager steps made"):
        draws.randn(8, 3, stream=2, device="cpu")
    with pytest.raises(CaptureError, match="BatchInfo.step read inside the captured step"):
        _ = draws.step
    with pytest.raises(CaptureError, match="device='cpu'"):
        StaticDraws(torch.device("cuda", 0), recording.draws)


# ---- the graphed step against the eager one, on the CPU --------------------------------------------------------

def host_replay(ctx):
    """CudaGraph's stand-in: capture runs the body once and puts back everything it changed (a real capture
    computes nothing); a replay runs the body again, gradients first unset (a captured backward writes them)."""

    class HostReplay:
        side_stream = staticmethod(contextlib.nullcontext)

        @staticmethod
        def event():
            return type("Done", (), {"synchronize": lambda self: None})()

        def capture(self, body):
            tensors = _state_tensors(ctx)
            saved, rng = [t.detach().clone() for t in tensors], torch.get_rng_state()
            body()
            with torch.no_grad():
                for t, s in zip(tensors, saved):
                    t.copy_(s)
            torch.set_rng_state(rng)
            self.body = body

        def replay(self):
            ctx.optimizer.zero_grad(set_to_none=True)
            self.body()

    return HostReplay


def _state_tensors(ctx) -> list[torch.Tensor]:
    out = list(ctx.raw_model.parameters()) + list(ctx.raw_model.buffers())
    out += [v for state in ctx.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    if ctx.ema is not None:
        out += list(ctx.ema.module.parameters()) + list(ctx.ema.module.buffers())
    return out


def _context(tmp_path, monkeypatch, *extra: str):
    from hpctrain.train import optim, run
    from hpctrain.train.choices import choose_launch

    # The fused optimizer, as on a GPU (its tensor learning rate and non-finite skip are what graphed relies on).
    build = optim.build_optimizer
    monkeypatch.setattr(optim, "build_optimizer", lambda *a, **k: build(*a, **(k | {"fused": True})))
    cls, cfg = resolve_config("ddpm_cifar10", None, TINY + (f"run.dir={tmp_path}",) + extra)
    runtime = single_process_runtime(torch.device("cpu"))
    choices = choose_launch(cfg, runtime, cls)
    torch.manual_seed(0)
    return run.build_context(choices.cfg, runtime, cls(choices.cfg), config_text="", write_run_dir=False,
                             pretrained=False, choices=choices)


def _train(ctx, steps: int, poison: dict[int, str] | None = None,
           extra: object = None) -> tuple[list[float], list[float | None]]:
    """``steps`` optimizer steps as loop.train takes them; per step the loss and gradient norm. ``poison``: at a
    step, 'short' drops a sample from each micro-batch. ``extra``: an object appended to every batch, or a function
    of the step that gives it."""
    torch.manual_seed(ctx.state.step)  # dropout's draws: the same stream for each of the runs compared
    window = loop._Window(ctx.state.step)
    ctx.sampler.set_position(ctx.state.epoch, ctx.state.step_in_epoch)
    batches = _poisoned(iter(ctx.train_loader), ctx, poison or {})
    if extra is not None:
        batches = ((*batch, extra(ctx.state.step) if callable(extra) else extra) for batch in batches)
    losses, norms = [], []
    for _ in range(steps):
        loss, norm = ctx.stepper(ctx, batches, window)
        ctx.state.advance(ctx.batches.global_batch_size, ctx.sampler.steps_per_epoch)
        losses.append(float(loss))
        norms.append(None if norm is None else float(norm))
    return losses, norms


def _poisoned(batches, ctx, poison):
    for batch in batches:
        if poison.get(ctx.state.step) == "short":
            batch = tuple(t[:-1] for t in batch)
        yield batch


def _weights(ctx) -> list[torch.Tensor]:
    return [t.detach().clone() for t in list(ctx.raw_model.parameters()) + list(ctx.ema.module.parameters())]


@pytest.fixture
def pair(tmp_path, monkeypatch):
    def make(*extra):
        eager = _context(tmp_path / "eager", monkeypatch, *extra)
        graphed = _context(tmp_path / "graphed", monkeypatch, *extra)
        graphed.stepper = GraphedStep(warmup=2, graph_class=host_replay(graphed))
        return eager, graphed
    return make


@pytest.mark.parametrize("layout", ["train.channels_last=auto", "train.channels_last=true"])
def test_the_graphed_step_trains_as_the_eager_one(pair, layout):
    """auto is NCHW on the CPU; true keeps the channels_last case (a GPU's eager default for this U-Net) covered."""
    eager, graphed = pair(layout)
    wanted = torch.channels_last if layout.endswith("true") else torch.contiguous_format
    for ctx in (eager, graphed):
        assert ctx.cfg.train.channels_last_on is (layout.endswith("true"))
        conv = next(m for m in ctx.raw_model.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3))
        assert conv.weight.is_contiguous(memory_format=wanted) and not conv.weight.is_contiguous(
            memory_format=torch.contiguous_format if layout.endswith("true") else torch.channels_last)
    assert isinstance(eager.stepper, EagerStep)
    e_loss, e_norm = _train(eager, 7)
    g_loss, g_norm = _train(graphed, 7)
    assert graphed.stepper.graph is not None, "never captured"
    assert len(graphed.stepper.infos[0].draws) == 2  # the timesteps and the noise, refilled every step
    assert g_loss == pytest.approx(e_loss, rel=1e-5) and g_norm == pytest.approx(e_norm, rel=1e-5)
    for a, b in zip(_weights(graphed), _weights(eager)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # The schedule moved the float rates as in eager mode; the optimizer holds no device tensors for them.
    assert [g["lr"] for g in graphed.optimizer.param_groups] == [g["lr"] for g in eager.optimizer.param_groups]
    assert not hasattr(graphed.optimizer, "found_inf")
    assert int(graphed.ema.n_averaged) == int(eager.ema.n_averaged) == 7


def test_a_non_finite_gradient_skips_the_update_and_the_ema(pair, monkeypatch):
    _, graphed = pair()
    _train(graphed, 3)
    before, steps = _weights(graphed), [s["step"].clone() for s in graphed.optimizer.state.values()]
    randn = BatchInfo.randn
    # The noise of step 3 is NaN (refilled into the graph's static buffer like any draw): so are its loss and gradient.
    monkeypatch.setattr(BatchInfo, "randn",
                        lambda self, *a, **k: randn(self, *a, **k) * (math.nan if self.step == 3 else 1))
    losses, norms = _train(graphed, 1)
    assert math.isnan(losses[0]) and math.isnan(norms[0])
    for a, b in zip(_weights(graphed), before):
        assert torch.equal(a, b)
    assert all(torch.equal(s["step"], old) for s, old in zip(graphed.optimizer.state.values(), steps))
    after, _ = _train(graphed, 2)
    assert all(math.isfinite(x) for x in after)


def test_a_batch_of_another_shape_runs_eagerly_and_the_graph_goes_on(pair, caplog):
    eager, graphed = pair()
    poison = {4: "short"}
    e_loss, _ = _train(eager, 7, poison)
    g_loss, _ = _train(graphed, 7, poison)
    assert g_loss == pytest.approx(e_loss, rel=1e-5)
    assert "a batch of another shape than the captured one" in caplog.text


def test_a_step_that_cannot_be_captured_falls_back_under_auto_and_fails_when_asked_for(tmp_path, monkeypatch):
    ctx = _context(tmp_path, monkeypatch)
    reads_step = lambda model, batch, info: model(batch[0].float(), torch.full((8,), info.step)).mean()  # noqa: E731
    monkeypatch.setattr(ctx.experiment, "train_loss", reads_step)
    ctx.stepper = GraphedStep(warmup=1, graph_class=host_replay(ctx), fallback=True, cudnn_for_graph=True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)  # as auto set it for the graph
    losses, _ = _train(ctx, 3)
    assert ctx.stepper.failed.startswith("BatchInfo.step read") and all(math.isfinite(x) for x in losses)
    assert not torch.backends.cudnn.benchmark  # eager steps may meet new shapes: no search for each
    strict = _context(tmp_path / "strict", monkeypatch)
    monkeypatch.setattr(strict.experiment, "train_loss", reads_step)
    strict.stepper = GraphedStep(warmup=1, graph_class=host_replay(strict))
    with pytest.raises(UserError, match="train.step_mode=graphed: BatchInfo.step read"):
        _train(strict, 2)
    assert not hasattr(strict.optimizer, "found_inf") and isinstance(strict.optimizer.param_groups[0]["lr"], float)


def test_out_of_memory_during_the_capture_says_what_to_lower(tmp_path, monkeypatch):
    ctx = _context(tmp_path, monkeypatch)
    graph = host_replay(ctx)

    class Full(graph):
        def capture(self, body):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    ctx.stepper = GraphedStep(warmup=1, graph_class=Full, fallback=True)
    with pytest.raises(UserError, match="out of GPU memory while capturing") as err:
        _train(ctx, 2)
    assert "lower train.micro_batch_size" in err.value.hint


def test_a_batch_that_is_not_tensors_is_not_captured(tmp_path, monkeypatch):
    """An object in the batch (model.gpu_decode's undecoded JPEGs) would be decoded once at capture and never again:
    refused, and under auto the run goes on eagerly."""
    ctx = _context(tmp_path, monkeypatch)
    ctx.stepper = GraphedStep(warmup=1, graph_class=host_replay(ctx), fallback=True)
    loss = ctx.experiment.train_loss
    monkeypatch.setattr(ctx.experiment, "train_loss", lambda model, batch, info: loss(model, batch[:1], info))
    losses, _ = _train(ctx, 3, extra=object())
    assert ctx.stepper.failed.startswith("the batch holds object, not tensors") and all(map(math.isfinite, losses))


def _weighted(ctx, monkeypatch) -> None:
    """The loss scaled by a Python float the batch carries (a collate's per-batch loss weight or mixup lambda)."""
    loss = ctx.experiment.train_loss
    monkeypatch.setattr(ctx.experiment, "train_loss", lambda model, batch, info: loss(model, batch[:-1], info) * batch[-1])


def test_a_changed_python_number_in_the_batch_runs_eagerly_never_the_captured_value(pair, monkeypatch, caplog):
    """A replay would compute with the value the capture saw (issue 37: graphed losses 3.16, 3.02, 3.04 where eager
    had 4.22, 5.04, 6.08): a batch whose non-tensor leaves differ from the captured ones runs eagerly."""
    eager, graphed = pair()
    for ctx in (eager, graphed):
        _weighted(ctx, monkeypatch)
    weight = lambda step: 1.0 + 0.25 * step  # noqa: E731
    e_loss, _ = _train(eager, 6, extra=weight)
    g_loss, _ = _train(graphed, 6, extra=weight)
    assert graphed.stepper.graph is not None
    assert g_loss == pytest.approx(e_loss, rel=1e-5)
    assert "non-tensor value 0 (float) is 1.75, captured as 1.5; such steps run eagerly" in caplog.text
    assert "return it from the collate as a tensor" in caplog.text


def test_an_unchanged_python_number_is_replayed_and_a_changed_one_stops_a_distributed_run(pair, monkeypatch):
    """Under DDP the other ranks would replay their captured all-reduces: a changed value is an error there."""
    _, graphed = pair()
    _weighted(graphed, monkeypatch)
    eager_steps = []
    monkeypatch.setattr(graphed.stepper, "_eager_with", lambda *a, **k: eager_steps.append(a) or (0, None))
    _train(graphed, 5, extra=0.5)
    assert graphed.stepper.graph is not None and not eager_steps  # a constant stays a constant: replayed
    graphed.runtime = dataclasses.replace(graphed.runtime, world_size=2)
    with pytest.raises(UserError, match="step 5 has a batch whose non-tensor value 0 .float. is 2.0, captured as 0.5 "
                                        "on rank 0") as err:
        _train(graphed, 1, extra=2.0)
    assert err.value.hint.startswith("return it from the collate as a tensor")
