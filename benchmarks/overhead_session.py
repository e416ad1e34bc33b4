"""One rank of the overhead benchmark's level-3 row (run by hpctrain's launcher like torchrun): the plain loop of
overhead_worker.py written as a loop of its own under hpctrain.session(): run.wrap for DDP, run.steps for the data
and the step boundary (vote, records, heartbeat), step.backward for the backward, the optimizer stepped and zeroed
by the loop itself, as the plain loop does. hpctrain's train records at the window's ends time it, as for the
hpctrain row.

    python -m hpctrain.launch --standalone --nproc-per-node 2 benchmarks/overhead_session.py mlp|tiny key=value ...
"""

import sys

import torch

import hpctrain
from overhead import LR, build_data, build_model, loss_fn

name = sys.argv[1]
with hpctrain.session(overrides=sys.argv[2:], name=f"overhead-session-{name}") as run:
    model = run.wrap(build_model(name))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    run.register(model=model, opt=opt)
    for step in run.steps(build_data(name)):
        for (x, y), _ in step.micro_batches():
            loss = loss_fn(name, model(x), y)
            step.backward(loss)
            step.log(loss=loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
