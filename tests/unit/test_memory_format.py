"""train.channels_last: auto resolved per launch (train/memory_format.py, chosen with the step mode in
train/choices.py), the config keeping the user's value."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

from hpctrain.config.load import load_config
from hpctrain.config.describe import describe_keys
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.config.validate import ConfigError
from hpctrain.errors import UserError
from hpctrain.resolution import resolve_config as resolve
from hpctrain.train.choices import ModelSource, choose_launch
from hpctrain.train.memory_format import ModelTraits, choose_memory_format, inspect_model, model_traits, resolve_memory_format

GN = ModelTraits(convolutions=True, group_norm=True)
BN = ModelTraits(convolutions=True, group_norm=False)
MLP = ModelTraits(convolutions=False, group_norm=False)


def cuda_runtime(world_size: int = 1):
    """A runtime that says CUDA (nothing here touches the device: the layout is chosen from it, not on it)."""
    cpu = single_process_runtime(torch.device("cpu"))
    return dataclasses.replace(cpu, device=torch.device("cuda", 0), world_size=world_size,
                               backend="nccl" if world_size > 1 else "")


@pytest.mark.parametrize(("setting", "device", "mode", "traits", "want"), [
    (True, "cpu", "eager", None, True),  # explicit wins everywhere
    (False, "cuda", "eager", BN, False),
    ("auto", "cpu", "graphed", BN, False),  # the CPU: torch's default
    ("auto", "cuda", "eager", GN, True),  # eager is host-bound: channels_last's convolutions win (908 vs 781)
    ("auto", "cuda", "compiled", GN, True),
    ("auto", "cuda", "graphed", GN, False),  # GroupNorm's conversions are GPU time under a graph (2,209 vs 1,966)
    ("auto", "cuda", "graphed", BN, True),  # batch norm has channels_last kernels (1,113 vs 753)
    ("auto", "cuda", "eager", MLP, False),  # nothing to gain, a .view() to lose
    ("auto", "cuda", "eager", None, False),  # not inspectable: torch's default
])
def test_choose_layout(setting, device, mode, traits, want):
    layout = choose_memory_format(setting, device, mode, traits)
    assert layout.channels_last is want
    assert layout.describe().startswith("channels_last (" if want else "NCHW (")


def test_model_traits():
    assert model_traits(nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8))) == GN
    assert model_traits(nn.Sequential(nn.ConvTranspose2d(3, 8, 3), nn.BatchNorm2d(8))) == BN
    assert model_traits(nn.Sequential(nn.Linear(3, 8), nn.LayerNorm(8))) == MLP


def test_the_reference_models_are_inspected_on_the_meta_device():
    ddpm, cfg = resolve("ddpm_cifar10", None, ())
    assert inspect_model(ddpm(cfg)) == GN
    faceseg, cfg = resolve("faceseg", None, ())
    assert inspect_model(faceseg(cfg)) == BN


class Unbuildable:
    def __init__(self, cfg, error: Exception):
        self.cfg, self.error = cfg, error

    def build_model(self):
        raise self.error


def test_a_model_that_cannot_be_built_on_meta_falls_back_to_nchw_with_a_warning(caplog):
    _, cfg = resolve("ddpm_cifar10", None, ())
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        resolved, layout = resolve_memory_format(cfg, cuda_runtime(), Unbuildable(cfg, OSError("weights.pt: no such file")),
                                          "eager")
    assert resolved.train.channels_last is False and "could not be inspected" in layout.reason
    assert "OSError: weights.pt: no such file" in caplog.text and "train.channels_last=true or false" in caplog.text


class MustNotBuild:
    def __init__(self, cfg):
        self.cfg = cfg

    def build_model(self):
        pytest.fail("only the main rank builds the model")  # not an Exception: inspect_model cannot swallow it


def test_on_the_cpu_auto_builds_no_model():
    """The traits decide nothing off CUDA: no start-up spent building the model on meta."""
    _, cfg = resolve("ddpm_cifar10", None, ())
    resolved, layout = resolve_memory_format(cfg, single_process_runtime(torch.device("cpu")), MustNotBuild(cfg), "eager")
    assert resolved.train.channels_last is False and layout.reason == "train.channels_last=auto: on cpu, not CUDA"


def test_the_main_ranks_verdict_is_every_ranks(monkeypatch):
    """Only rank 0 builds the model on meta; the others take its traits (DDP refuses weights of mixed formats),
    or its error: a UserError from building the model (a bad option) stops every rank with that message."""
    import hpctrain.train.memory_format as layout_module

    _, cfg = resolve("ddpm_cifar10", None, ())
    sent = []

    def broadcast(verdict):
        monkeypatch.setattr(layout_module, "broadcast_object", lambda obj, runtime: sent.append(obj) or verdict)

    rank1 = dataclasses.replace(cuda_runtime(2), rank=1)
    broadcast(("ok", GN, ""))
    resolved, layout = resolve_memory_format(cfg, rank1, MustNotBuild(cfg), "graphed")
    assert sent == [None] and resolved.train.channels_last is False and "GroupNorm" in layout.reason
    broadcast(("error", "model.depth=0", "set it to 1 or more."))
    with pytest.raises(UserError, match="model.depth=0") as raised:
        resolve_memory_format(cfg, rank1, MustNotBuild(cfg), "graphed")
    assert raised.value.hint == "set it to 1 or more." and raised.value.on_every_rank
    # The main rank sends its own error, then raises it as every rank does.
    sent.clear()
    monkeypatch.setattr(layout_module, "broadcast_object", lambda obj, runtime: sent.append(obj) or obj)
    failing = Unbuildable(cfg, UserError("model.depth=0", "set it to 1 or more."))
    with pytest.raises(UserError, match="model.depth=0"):
        resolve_memory_format(cfg, cuda_runtime(2), failing, "graphed")
    assert sent == [("error", "model.depth=0", "set it to 1 or more.")]


def test_the_launch_choices_follow_the_step_mode(monkeypatch):
    """ddpm_cifar10 (auto): one process on CUDA graphs its step, so NCHW; over several GPUs it steps eagerly (capture
    under DDP is opt-in), so channels_last; on the CPU NCHW; eval and sample run no optimizer step."""
    monkeypatch.setattr("hpctrain.train.precision.auto_precision", lambda device: "bf16")  # an Ampere or later GPU
    monkeypatch.setattr("hpctrain.train.memory_format.broadcast_object", lambda obj, runtime: obj)  # no process group here
    cls, cfg = resolve("ddpm_cifar10", None, ())
    assert cfg.train.channels_last == "auto"
    one = choose_launch(cfg, cuda_runtime(1), cls)
    assert one.cfg.train.channels_last is False and one.step.mode == "graphed" and one.precision.name == "bf16"
    assert choose_launch(cfg, cuda_runtime(2), cls).cfg.train.channels_last is True
    evaluation = choose_launch(cfg, cuda_runtime(1), cls, training=False)
    assert evaluation.cfg.train.channels_last is True and evaluation.step.mode == "eager"
    assert choose_launch(cfg, single_process_runtime(torch.device("cpu")), cls).cfg.train.channels_last is False
    _, explicit = resolve("ddpm_cifar10", None, ("train.channels_last=true",))
    assert choose_launch(explicit, cuda_runtime(1), cls).cfg.train.channels_last is True
    monkeypatch.setattr("hpctrain.train.precision.auto_precision", lambda device: "fp16")  # a V100: never graphed
    assert choose_launch(cfg, cuda_runtime(1), cls).cfg.train.channels_last is True


def test_the_launch_choices_build_no_experiment(monkeypatch, caplog):
    """The experiment is built once, by the run, from the resolved config: the choices inspect the class's model
    without running its __init__ (on no rank: a user's __init__ may hold a collective); a build_model that needs its
    own __init__'s state cannot be inspected, which the launch says, choosing NCHW."""
    monkeypatch.setattr("hpctrain.train.precision.auto_precision", lambda device: "bf16")
    monkeypatch.setattr("hpctrain.train.memory_format.broadcast_object", lambda obj, runtime: obj)
    ddpm, cfg = resolve("ddpm_cifar10", None, ())
    built = []

    class Counted(ddpm):
        def __init__(self, cfg) -> None:
            built.append(cfg)
            super().__init__(cfg)

    assert choose_launch(cfg, cuda_runtime(2), Counted).memory_format.channels_last is True
    assert built == []

    class NeedsInit(Counted):
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            self.width = 8

        def build_model(self) -> nn.Module:
            return nn.Sequential(nn.Linear(self.width, 8))

    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        chosen = choose_launch(cfg, cuda_runtime(2), NeedsInit)
    assert chosen.memory_format.channels_last is False and built == []
    assert "could not build" in caplog.text and "train.channels_last=true or false" in caplog.text


def test_an_experiment_that_sets_graphable_in_its_init_decides_the_step_mode(monkeypatch):
    """graphable set by an __init__ (for some options) is the instance's word, as before the choices came first."""
    from hpctrain.train.choices import with_instance_graphable

    monkeypatch.setattr("hpctrain.train.precision.auto_precision", lambda device: "bf16")
    monkeypatch.setattr("hpctrain.train.memory_format.broadcast_object", lambda obj, runtime: obj)
    ddpm, cfg = resolve("ddpm_cifar10", None, ())
    runtime = cuda_runtime(1)
    choices = choose_launch(cfg, runtime, ddpm)
    assert choices.step.mode == "graphed"

    class NotHere(ddpm):
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            self.graphable = False

    assert with_instance_graphable(choices, NotHere(choices.cfg), runtime).step.mode != "graphed"
    assert with_instance_graphable(choices, ddpm(choices.cfg), runtime) is choices


def test_an_unresolved_auto_reads_as_nchw_not_as_a_true_string():
    """An experiment built by hand from load_config never went through resolve_memory_format: torch's default layout, for
    the model and its batches alike."""
    from hpctrain.dist.wrap import place_model
    cls, cfg = resolve("ddpm_cifar10", None, ())
    assert cfg.train.channels_last == "auto" and cfg.train.channels_last_on is False
    model = place_model(nn.Conv2d(3, 8, 3), cfg, single_process_runtime(torch.device("cpu")))
    assert not model.weight.is_contiguous(memory_format=torch.channels_last)
    images = (torch.zeros(2, 3, 8, 8, dtype=torch.uint8),)
    x0 = cls(cfg)._x0(images)
    assert x0.is_contiguous() and not x0.is_contiguous(memory_format=torch.channels_last)
    _, explicit = resolve("ddpm_cifar10", None, ("train.channels_last=true",))
    assert cls(explicit)._x0(images).is_contiguous(memory_format=torch.channels_last)


def test_the_config_takes_true_false_or_auto_and_says_so():
    from hpctrain.experiments.digits import DigitsExperiment, DigitsOptions

    def load(value: str):
        return load_config("digits", DigitsOptions, experiment_defaults=DigitsExperiment.defaults,
                           overrides=[f"train.channels_last={value}"]).train.channels_last

    assert (load("true"), load("false"), load("auto")) == (True, False, "auto")
    assert resolve("ddpm_cifar10", None, ())[1].train.channels_last == "auto"  # the reference opts in
    for bad in ("1", "yes"):
        with pytest.raises(ConfigError, match="expects one of true, false, 'auto', got " + bad):
            load(bad)
    cfg = load_config("digits", DigitsOptions, experiment_defaults=DigitsExperiment.defaults)
    assert "train.channels_last = false  (one of true, false, 'auto')" in describe_keys(cfg)  # the default
