"""Level 3 of the bring-your-own-training tests: tests/gan_experiment.py's GAN in a loop of its own, under
hpctrain.session(); key=value arguments are the session's overrides."""

import sys

import torch

import hpctrain
from gan_experiment import SETTINGS, Discriminator, Generator, d_loss, g_loss, points

with hpctrain.session(SETTINGS, overrides=sys.argv[1:]) as run:
    g = run.wrap(Generator(), ema=run.cfg.optim.ema_decay)
    d = run.wrap(Discriminator())
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-3, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(d.parameters(), lr=1e-3, betas=(0.5, 0.99))
    steps = run.steps(points(256, 1))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt_g, lambda step: 1.0 - step / steps.total)
    run.register(g=g, d=d, opt_g=opt_g, opt_d=opt_d, schedule=schedule)
    for step in steps:
        for (real,), info in step.micro_batches("opt_d"):
            loss = d_loss(g, d, real, info)
            step.backward(loss)
            step.log(loss_d=loss.detach())
        step.optimizer_step("opt_d")
        for (real,), info in step.micro_batches("opt_g"):
            loss = g_loss(g, d, real, info)
            step.backward(loss)
            step.log(loss_g=loss.detach())
        step.optimizer_step("opt_g")
        schedule.step()
