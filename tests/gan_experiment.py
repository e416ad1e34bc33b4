"""A small GAN for the bring-your-own-training tests: a generator and a discriminator with batch norm, two Adam
optimizers with different betas, an EMA of the generator, on points of a 2-D Gaussian. Level 2 (GanStep, run as
'gan_experiment:GanStep') and level 3 (tests/gan_loop.py, the same arithmetic in a loop of its own) share it.
Per-sample noise comes from BatchInfo, so 1 x 4, 2 x 2 and 4 x 1 processes x accumulation draw the same."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.functional import binary_cross_entropy_with_logits as bce
from torch.utils.data import TensorDataset

from hpctrain import Datasets, StepExperiment

NOISE = 4
SETTINGS = {"train.global_batch_size": 32, "train.micro_batch_size": 8, "train.max_steps": 12, "log.every_steps": 1,
            "log.tensorboard": False, "log.plots": False, "optim.ema_decay": 0.9, "data.num_workers": 0}


def points(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 2, generator=g) * 0.5 + 1.0)


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(NOISE, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.BatchNorm1d(16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def d_loss(g: nn.Module, d: nn.Module, real: torch.Tensor, info) -> torch.Tensor:
    fake = g(info.randn(len(real), NOISE, device=real.device))
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    return bce(d(real), ones) + bce(d(fake), zeros)


def g_loss(g: nn.Module, d: nn.Module, real: torch.Tensor, info) -> torch.Tensor:
    return bce(d(g(info.randn(len(real), NOISE, device=real.device))), torch.ones(len(real), 1))


@dataclass(frozen=True, kw_only=True)
class GanOptions:
    lr: float = 1e-3
    """Both optimizers' learning rate."""


class GanStep(StepExperiment):
    """Level 2: hpctrain's loop, this step."""

    config_class = GanOptions
    defaults = SETTINGS
    ema_models = ("g",)

    def build_models(self):
        return {"g": Generator(), "d": Discriminator()}

    def build_optimizers(self, models):
        lr = self.options.lr
        return {"g": (torch.optim.Adam(models["g"].parameters(), lr=lr, betas=(0.5, 0.9)),
                      lambda step: 1.0 - step / self.cfg.train.max_steps),
                "d": torch.optim.Adam(models["d"].parameters(), lr=lr, betas=(0.5, 0.99))}

    def build_datasets(self):
        return Datasets(train=points(256, 1), val=points(40, 2))

    def train_step(self, step):
        g, d = step.models["g"], step.models["d"]
        for (real,), info in step.micro_batches("d"):
            loss = d_loss(g, d, real, info)
            step.backward(loss)
            step.log(loss_d=loss.detach())
        step.optimizer_step("d")
        for (real,), info in step.micro_batches("g"):
            loss = g_loss(g, d, real, info)
            step.backward(loss)
            step.log(loss_g=loss.detach())
        step.optimizer_step("g")

    def eval_stats(self, models, batch, info):
        (real,) = batch
        fake = models["g"](info.randn(len(real), NOISE, device=real.device))
        return {"distance_sum": (fake.mean(0) - real.mean(0)).norm() * len(real),
                "count": torch.tensor(float(len(real)))}
