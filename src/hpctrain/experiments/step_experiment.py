"""The protocol of an experiment that writes its own step: several models, several optimizers, alternating updates
(a GAN vocoder's generator and discriminator), a frozen teacher, any torch optimizer. hpctrain still owns the loop,
the data order, the process group, the checkpoints, the stop vote, validation, logs and heartbeats; the experiment
says what one optimizer step does, through the ``Step`` it is handed (hpctrain.userloop.step).

Why the whole step and not one micro-batch at a time: an update of one model that another model's loss reads in
the same step (the discriminator's, before the generator's) must see every micro-batch of the step first, or the
result depends on how the global batch is split into micro-batches and ranks. ``step.micro_batches("d")`` runs over
this rank's micro-batches of the step with the gradient sync of the models ``d`` steps switched on in the last one
only, and may be run again for the next optimizer: the same micro-batches, in the same order.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import torch
from torch import nn

from hpctrain.errors import UserError, on_every_rank
from hpctrain.experiments.base import BatchInfo, Experiment, sums_over_count

if TYPE_CHECKING:
    from hpctrain.userloop.step import Step


class StepExperiment(Experiment):
    """Subclass it and implement build_models, build_optimizers, build_datasets and train_step (and eval_stats when
    there is a validation set). The models' dict becomes one nn.ModuleDict wherever one model is expected (export,
    eval, sample, checkpoints: each model's parameters named ``<name>.<parameter>``)."""

    graphable: ClassVar[bool] = False
    """A step of the experiment's own runs eagerly (its optimizers, its phases): never captured as a CUDA graph."""
    ema_models: ClassVar[tuple[str, ...]] = ()
    """The models to keep an exponential moving average of (decay optim.ema_decay, which must then be > 0),
    updated after each step; validation, outputs and export use the averaged weights of these models."""

    @abstractmethod
    def build_models(self) -> Mapping[str, nn.Module]:
        """Fresh models on the CPU by name (hpctrain places, wraps per dist.strategy and checkpoints each)."""

    @abstractmethod
    def build_optimizers(self, models: Mapping[str, nn.Module]) -> Mapping[str, Any]:
        """Optimizers by name, each an ``Optimizer`` or a pair ``(optimizer, schedule)`` where the schedule is an
        ``LRScheduler`` of it or a function of the step returning the factor of the initial rate (run as LambdaLR).
        ``models``: the placed and wrapped models' own modules, by name (build the optimizers from their
        parameters: DTensor shards under fsdp). Every parameter belongs to one optimizer at most; parameters of no
        optimizer are frozen (a teacher)."""

    @abstractmethod
    def train_step(self, step: "Step") -> None:
        """One optimizer step: for each optimizer, run over ``step.micro_batches(name)`` (forward, then
        ``step.backward(loss)``), then ``step.optimizer_step(name)``; ``step.log(name=value)`` what the train
        records show (means, or (sum, count) pairs: all-reduced over the ranks)."""

    def build_model(self) -> nn.Module:
        """The models of build_models in one nn.ModuleDict (export, eval and sample load a checkpoint into it)."""
        return nn.ModuleDict(dict(self.build_models()))

    def train_loss(self, model: nn.Module, batch: Any, info: BatchInfo) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} is a StepExperiment: hpctrain calls its train_step, not train_loss")

    def eval_stats(self, model: nn.Module, batch: Any, info: BatchInfo) -> Mapping[str, torch.Tensor]:
        """Sums over one validation batch, as Experiment.eval_stats, with ``model`` the nn.ModuleDict of the
        models (the averaged ones for ema_models): ``model["g"]``. No default: a StepExperiment with a
        validation set implements it."""
        raise on_every_rank(UserError(f"{type(self).__name__} has a validation set but no eval_stats",
                                      "implement eval_stats(self, models, batch, info) returning sums, or return no "
                                      "val set."))

    def metrics(self, totals: Mapping[str, Any]) -> dict[str, float]:
        """Metrics from the summed statistics. Default: each ``X_sum`` over ``count`` as ``X``."""
        return sums_over_count(totals)


def is_step_experiment(cls: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, StepExperiment)
