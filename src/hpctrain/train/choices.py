"""What a worker chooses once per launch, before it builds its experiment: the precision, the step mode and the
memory format (train.channels_last resolved, which follows the step mode), with the config that carries them.

The experiment is built once, from the resolved config: experiments read train.channels_last_on while they run
(their batches are converted to the model's format). So the memory format is chosen before the experiment exists,
from its model built on the meta device by the class's own build_model (memory_format.inspect_model)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hpctrain.config.schema import RunConfig
from hpctrain.dist.runtime import Runtime
from hpctrain.experiments.base import Experiment, owns_optimizer
from hpctrain.train.memory_format import MemoryFormat, resolve_memory_format
from hpctrain.train.precision import Precision, resolve_precision
from hpctrain.train.step_mode import StepChoice, choose_step_mode


@dataclass(frozen=True)
class LaunchChoices:
    cfg: RunConfig
    """The config with what depends on this launch's device resolved (train.channels_last as true or false)."""
    precision: Precision
    """train.precision resolved on this rank's device."""
    step: StepChoice
    """train.step_mode resolved (eager for evaluation, which runs no optimizer step)."""
    memory_format: MemoryFormat
    """The model's and the batches' memory format, and why (training's start-up lines say it)."""


def choose_launch(cfg: RunConfig, runtime: Runtime, experiment_cls: type[Experiment], training: bool = True
                  ) -> LaunchChoices:
    """The choices of this launch; collective under train.channels_last=auto (resolve_memory_format). The step mode
    reads the class's ``graphable`` (a ClassVar of the protocol)."""
    precision = resolve_precision(cfg.train.precision, runtime.device)
    if training:
        step = choose_step_mode(cfg, runtime, precision, experiment_cls.graphable, owns_optimizer(experiment_cls))
    else:
        step = StepChoice("eager", "evaluation runs no optimizer step")
    resolved, memory_format = resolve_memory_format(cfg, runtime, ModelSource(experiment_cls, cfg), step.mode)
    return LaunchChoices(resolved, precision, step, memory_format)


class ModelSource:
    """What resolve_memory_format inspects: the class's build_model, without the experiment, whose own __init__ then
    runs once, with the resolved config. build_model is called on an instance on which only Experiment's __init__
    ran (cfg and options: what the protocol's build_model may read under train.channels_last=auto). One that needs
    more of its class's own __init__ fails there, and the launch says so and uses NCHW (memory_format's warning):
    a full instance built for the inspection would run the user's __init__ on the main rank alone, inside the meta
    device, while the other ranks wait for the verdict."""

    def __init__(self, experiment_cls: type[Experiment], cfg: RunConfig) -> None:
        self.experiment_cls = experiment_cls
        self.cfg = cfg

    def build_model(self) -> Any:
        bare = self.experiment_cls.__new__(self.experiment_cls)
        Experiment.__init__(bare, self.cfg)
        return bare.build_model()


def with_instance_graphable(choices: LaunchChoices, experiment: Experiment, runtime: Runtime) -> LaunchChoices:
    """The step mode again when the built experiment says ``graphable`` otherwise than its class (an __init__ that
    sets it for some options): the instance decides, as it did before the choices came first. The memory format
    chosen for the class's mode stays (the model is placed in it); at worst it is the other mode's faster one."""
    if experiment.graphable == type(experiment).graphable:
        return choices
    step = choose_step_mode(choices.cfg, runtime, choices.precision, experiment.graphable,
                            owns_optimizer(type(experiment)))
    return replace(choices, step=step)
