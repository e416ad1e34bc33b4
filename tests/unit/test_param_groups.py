"""Parameter groups with their own learning rate, the poly schedule, SyncBatchNorm's CPU refusal."""

import pytest
import torch
from torch import nn

from hpctrain.config.schema import OptimSection
from hpctrain.errors import UserError
from hpctrain.train.optim import base_lr, build_optimizer, build_scheduler, lr_factor


def _model():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1))


def test_groups_scale_the_rate_and_keep_decay_off_1d_params():
    model = _model()
    backbone = list(model[0].parameters()) + list(model[1].parameters())
    head = list(model[2].parameters())
    cfg = OptimSection(name="sgd", lr=0.1, weight_decay=1e-4, schedule="poly", warmup_steps=0)
    opt = build_optimizer(model, cfg, groups=[{"params": backbone, "lr_scale": 0.1, "name": "backbone"},
                                              {"params": head, "name": "head"}])
    rates = {(g["name"], g["weight_decay"]): g["lr"] for g in opt.param_groups if g["params"]}
    assert rates == {("backbone", 1e-4): pytest.approx(0.01), ("backbone", 0.0): pytest.approx(0.01),
                     ("head", 1e-4): pytest.approx(0.1), ("head", 0.0): pytest.approx(0.1)}
    for g in opt.param_groups:  # 1-D tensors (biases, norm weights) never decay
        assert all(p.ndim >= 2 for p in g["params"]) or g["weight_decay"] == 0.0
    sched = build_scheduler(opt, cfg, total_steps=10)
    for _ in range(5):
        opt.step()
        sched.step()
    factor = (1 - 5 / 10) ** 0.9
    assert base_lr(opt) == pytest.approx(0.1 * factor)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * factor)  # same schedule, its own scale


def test_poly_schedule_with_warmup():
    cfg = OptimSection(lr=1.0, schedule="poly", poly_power=0.9, warmup_steps=4)
    assert [lr_factor(s, 14, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, 14, cfg) == 1.0
    assert lr_factor(9, 14, cfg) == pytest.approx(0.5 ** 0.9)
    assert lr_factor(14, 14, cfg) == 0.0


@pytest.mark.parametrize("groups, message", [
    (lambda m: [{"params": list(m[0].parameters())}], "leaves 4 trainable parameter"),
    (lambda m: [{"params": list(m.parameters())}, {"params": list(m[2].parameters())}], "repeats 2 parameter"),
    (lambda m: [{"params": list(m.parameters()), "lr": 3.0}], "unknown keys"),
])
def test_bad_groups_are_refused(groups, message):
    model = _model()
    with pytest.raises(UserError, match=message):
        build_optimizer(model, OptimSection(), groups=groups(model))


def test_default_is_one_group_split_by_decay():
    opt = build_optimizer(_model(), OptimSection(lr=0.5))
    assert [len(g["params"]) for g in opt.param_groups] == [2, 4]
    assert {g["lr"] for g in opt.param_groups} == {0.5}


def test_sync_batchnorm_on_cpu_is_refused_and_auto_falls_back():
    from types import SimpleNamespace

    from hpctrain.dist.wrap import use_sync_batchnorm

    cpu_pair = SimpleNamespace(device=torch.device("cpu"), distributed=True)
    with pytest.raises(UserError, match="only on GPUs"):
        use_sync_batchnorm(_model(), "on", cpu_pair)
    assert use_sync_batchnorm(_model(), "auto", cpu_pair) is False
    gpu_pair = SimpleNamespace(device=torch.device("cuda", 0), distributed=True)
    assert use_sync_batchnorm(_model(), "auto", gpu_pair) is True
    assert use_sync_batchnorm(nn.Linear(2, 2), "auto", gpu_pair) is False  # no batch norm: nothing to convert
    assert use_sync_batchnorm(_model(), "auto", SimpleNamespace(device=torch.device("cuda", 0), distributed=False)) is False
