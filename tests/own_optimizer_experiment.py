"""Level 1 of the bring-your-own-training tests: tests/toy_experiment.py's regression with an optimizer class of the
test's own (Lion: the sign of an interpolated momentum, Chen et al. 2023) and a schedule given as a function of the
step, loaded as 'own_optimizer_experiment:LionToy'."""

from __future__ import annotations

import torch

from toy_experiment import LinearToy


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(exp_avg * beta1 + p.grad * (1 - beta1)), alpha=-group["lr"])
                exp_avg.lerp_(p.grad, 1 - beta2)


class LionToy(LinearToy):
    defaults = {**LinearToy.defaults, "train.max_steps": 12, "optim.lr": 0.3, "log.every_steps": 1,
                "log.tensorboard": False}

    def build_optimizer(self, groups):
        return Lion(groups, lr=self.cfg.optim.lr, betas=(0.9, 0.99))

    def build_scheduler(self, optimizer, total_steps):
        return lambda step: 0.5 ** (step / total_steps)
