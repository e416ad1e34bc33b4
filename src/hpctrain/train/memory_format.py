"""train.channels_last resolved: the memory format a run's convolutions work in, chosen once per launch (with the
step mode: train/choices.py) before the experiment is built (its batches are converted to the same format).

auto picks what was measured faster on one H100 (BENCHMARKS.md: the DDPM and DeepLabV3+ channels_last rows):
- on CUDA, channels_last (NHWC) for a model with 2-D convolutions: tensor cores' convolution kernels work in it;
- except NCHW for a model with GroupNorm whose step is graphed: torch has no channels_last GroupNorm kernel, so each
  one converts its input to NCHW and back, which the host hides in an eager step and a graph does not;
- NCHW on the CPU (not faster there) and for a model without convolutions (converting only risks a later .view()).
A compiled step that is not graphed counts as eager (host-bound; not measured). auto is ddpm_cifar10's setting; the
config's default stays false, so a user's model (which may .view() a convolution's output, which fails on a
channels_last tensor) changes layout only when asked. A graphed step that falls back to eager at its capture
(train.step_mode=auto) keeps the layout chosen for the graph: the model is already placed in it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from hpctrain.config.schema import RunConfig
from hpctrain.dist.collectives import broadcast_object
from hpctrain.dist.runtime import Runtime
from hpctrain.errors import UserError, on_every_rank

log = logging.getLogger("hpctrain")


@dataclass(frozen=True)
class MemoryFormat:
    channels_last: bool
    """The run's memory format: channels_last (NHWC) or NCHW, for the model's 4-D weights and its 4-D batches."""
    reason: str
    """Why, for the start-up line."""

    def describe(self) -> str:
        return f"{'channels_last' if self.channels_last else 'NCHW'} ({self.reason})"


@dataclass(frozen=True)
class ModelTraits:
    convolutions: bool
    """The model has 2-D convolutions (nn.Conv2d or nn.ConvTranspose2d)."""
    group_norm: bool
    """The model has nn.GroupNorm layers."""


def model_traits(model: nn.Module) -> ModelTraits:
    modules = list(model.modules())
    return ModelTraits(convolutions=any(isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)) for m in modules),
                       group_norm=any(isinstance(m, nn.GroupNorm) for m in modules))


def choose_memory_format(setting: bool | str, device_type: str, step_mode: str, traits: ModelTraits | None) -> MemoryFormat:
    """train.channels_last resolved (pure: the module docstring says why each case). ``traits`` None: the model
    could not be inspected."""
    if setting is True or setting is False:
        return MemoryFormat(setting, f"train.channels_last={'true' if setting else 'false'}")
    if device_type != "cuda":
        return MemoryFormat(False, f"train.channels_last=auto: on {device_type}, not CUDA")
    if traits is None:
        return MemoryFormat(False, "train.channels_last=auto: the model could not be inspected; set true or false")
    if not traits.convolutions:
        return MemoryFormat(False, "train.channels_last=auto: the model has no 2-D convolutions")
    if traits.group_norm and step_mode == "graphed":
        return MemoryFormat(False, "train.channels_last=auto: GroupNorm, which has no channels_last kernel, in a graphed "
                             "step")
    return MemoryFormat(True, "train.channels_last=auto: convolutions on CUDA")


def inspect_model(experiment: Any) -> ModelTraits | None:
    """The experiment's model built on the meta device (no memory, no initialisation kernels) and inspected; None,
    with a warning, when it cannot be built there (e.g. it reads weights while it is built). Only the model is built
    on meta: the experiment itself was made outside, so its own option errors stay what they are."""
    try:
        with torch.device("meta"):
            model = experiment.build_model()
    except UserError:
        raise
    except Exception as err:  # an experiment's own code: any other failure only means "not inspectable"
        log.warning("train.channels_last=auto: could not build %s's model on the meta device to inspect it (%s: %s); "
                    "using NCHW. Set train.channels_last=true or false to choose.", experiment.cfg.experiment,
                    type(err).__name__, err)
        return None
    return model_traits(model)


def resolve_memory_format(cfg: RunConfig, runtime: Runtime, experiment: Any, step_mode: str) -> tuple[RunConfig, MemoryFormat]:
    """``cfg`` with train.channels_last as true or false for this launch, and why. ``experiment``: built from
    ``cfg`` (its build_model is what is inspected). ``step_mode``: what the step will run as (train/step_mode.py
    choose_step_mode; eager for evaluation). Collective under auto: the main rank inspects the model and every rank
    takes its verdict, so all hold their weights in one format (DDP refuses a mix) and a UserError from building
    the model stops every rank with its message instead of leaving the others waiting. The collective runs on any
    device, so the CPU's tests run the one a GPU job does; the model is built only where its traits decide something
    (CUDA: 40 ms to 1.3 s of start-up for the reference models, torchvision's import included). The config written
    to the run directory stays the user's: a resume on another kind of node resolves auto again."""
    setting = cfg.train.channels_last
    traits = None
    if setting == "auto":
        verdict = broadcast_object(_inspection(experiment, runtime.device.type) if runtime.is_main else None, runtime)
        if verdict[0] == "error":
            raise on_every_rank(UserError(verdict[1], verdict[2]))
        traits = verdict[1]
    layout = choose_memory_format(setting, runtime.device.type, step_mode, traits)
    return replace(cfg, train=replace(cfg.train, channels_last=layout.channels_last)), layout


def _inspection(experiment: Any, device_type: str) -> tuple[str, Any, str]:
    """("ok", traits or None, "") or ("error", message, hint): what the main rank sends the others."""
    if device_type != "cuda":  # choose_memory_format needs no traits there: no model built
        return "ok", None, ""
    try:
        return "ok", inspect_model(experiment), ""
    except UserError as err:
        return "error", str(err.args[0]), err.hint
