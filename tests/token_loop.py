"""tests/token_experiment.py's sequence model in a loop of its own (level 3); key=value arguments override."""

import sys

import torch

import hpctrain
from token_experiment import SETTINGS, build_lm, pad, sequences, token_loss

with hpctrain.session(SETTINGS, overrides=sys.argv[1:]) as run:
    lm = run.wrap(build_lm())
    sgd = torch.optim.SGD(lm.parameters(), lr=run.cfg.optim.lr)
    run.register(lm=lm, sgd=sgd)
    for step in run.steps(sequences(), collate_fn=pad):
        for batch, _ in step.micro_batches():
            total, count = token_loss(lm, batch)
            step.backward((total, count))
            step.log(loss=(total.detach(), count))
        step.optimizer_step()
