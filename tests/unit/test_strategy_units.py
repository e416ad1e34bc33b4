"""dist.strategy without processes: the config's refusals, the default FSDP blocks, validation padding, ZeRO's
optimizer groups."""

import pytest
import torch
from torch import nn

from hpctrain.config.load import ConfigError
from hpctrain.data.sampler import EvalBatchSampler
from hpctrain.experiments.base import default_fsdp_blocks
from hpctrain.resolution import resolve_config as resolve


@pytest.mark.parametrize("override, key", [("dist.grad_compression=bf16", "dist.grad_compression"),
                                           ("train.sync_batchnorm=on", "train.sync_batchnorm"),
                                           ("train.compile=true", "train.compile")])
def test_fsdp_refuses_what_cannot_apply_to_it_and_says_why(override: str, key: str):
    with pytest.raises(ConfigError) as err:
        resolve("digits", None, ("dist.strategy=fsdp", override))
    assert f"'{key}'" in str(err.value) and "fsdp" in str(err.value)
    resolve("digits", None, ("dist.strategy=ddp", override))  # the same key is fine under ddp


def test_an_unknown_strategy_is_refused():
    with pytest.raises(ConfigError, match="strategy"):
        resolve("digits", None, ("dist.strategy=zero3",))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n, batch", [(397, 150), (397, 400), (10, 3), (0, 4), (12, 4)])
def test_padded_validation_gives_every_rank_the_same_number_of_batches_and_marks_the_padding(world, n, batch):
    samplers = [EvalBatchSampler(n, batch, r, world, pad=True) for r in range(world)]
    lengths = {len(list(s)) for s in samplers}
    assert len(lengths) == 1 and lengths == {len(samplers[0])}
    real = [(start, idx) for s in samplers for start, idx in zip(s.starts(), s) if start >= 0]
    padding = [idx for s in samplers for start, idx in zip(s.starts(), s) if start < 0]
    # The real batches are exactly the unpadded sampler's: every sample once.
    unpadded = [idx for r in range(world) for idx in EvalBatchSampler(n, batch, r, world)]
    assert sorted(map(tuple, (idx for _, idx in real))) == sorted(map(tuple, unpadded))
    assert sorted(i for _, idx in real for i in idx) == list(range(n))
    assert all(idx and idx == list(range(min(batch, n))) for idx in padding)  # a real batch, run and dropped


def test_default_blocks_take_blocks_and_list_items_never_containers():
    class ResBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 1)
            self.stages = nn.ModuleList([nn.ModuleList([ResBlock(), nn.Linear(4, 4)]), nn.Linear(4, 4)])
            self.encoder = nn.TransformerEncoderLayer(8, 2, 16)
            self.frozen = nn.ModuleList([nn.ReLU()])

    net = Net()
    blocks = default_fsdp_blocks(net)
    assert blocks == [net.stages[0][0], net.stages[0][1], net.stages[1], net.encoder]
    assert not any(isinstance(b, (nn.ModuleList, nn.ModuleDict)) for b in blocks)
    flat = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert default_fsdp_blocks(flat) == [flat[0], flat[2]]  # nothing block-like: the children with parameters


def test_zero1_optimizer_keeps_every_group_and_its_lr_scale():
    """ZeroRedundancyOptimizer on a one-rank gloo group, built from the experiment's groups as the plain optimizer
    is: same groups, same learning rates per group, hpctrain's own keys kept for the scheduler and the logs."""
    import tempfile

    import torch.distributed as dist

    from hpctrain.config.schema import OptimSection
    from hpctrain.train.optim import build_optimizer

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    groups = [{"params": list(model[0].parameters()), "lr_scale": 0.1, "name": "backbone"},
              {"params": list(model[1].parameters()), "lr_scale": 1.0, "name": "head"}]
    cfg = OptimSection(lr=1e-2)
    plain = build_optimizer(model, cfg, groups=groups)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
        try:
            zero = build_optimizer(model, cfg, groups=groups, zero=True)
            keys = ("lr", "weight_decay", "lr_scale", "name")
            assert [{k: g[k] for k in keys} for g in zero.param_groups] == \
                [{k: g[k] for k in keys} for g in plain.param_groups if g["params"]]
            model(torch.randn(3, 4)).sum().backward()
            zero.step()  # the inner optimizer steps with the outer groups' hyperparameters
            assert [g["lr"] for g in zero.optim.param_groups] == [g["lr"] for g in zero.param_groups]
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize(("backend", "overrides", "want"), [
    ("nccl", ("dist.strategy=fsdp", "dist.fsdp_cpu_offload=true"), "cpu:gloo,cuda:nccl"),
    ("nccl", ("dist.strategy=fsdp",), "nccl"),
    ("nccl", ("dist.strategy=ddp",), "nccl"),
    ("gloo", ("dist.strategy=fsdp", "dist.fsdp_cpu_offload=true"), "gloo"),
])
def test_cpu_offload_on_gpus_gives_the_training_group_gloo_for_host_tensors(backend, overrides, want):
    """The clipping norm of CPU-offloaded shards is an all-reduce of host tensors: NCCL alone refuses them."""
    from hpctrain.config.load import load_config
    from hpctrain.dist.runtime import backend_spec
    from hpctrain.experiments.digits.experiment import DigitsExperiment as cls

    cfg = load_config(cls.name, cls.config_class, experiment_defaults=cls.defaults, overrides=overrides)
    assert backend_spec(backend, cfg.dist) == want


def test_saved_optimizer_params_reads_parameters_and_their_state_from_dcp_names():
    """Dotted parameter names, and state keys without dots: the parameter is everything between prefix and key."""
    from hpctrain.checkpoint.state_dicts import saved_optimizer_params

    names = ["model.fc.weight", "optim.param_groups.fc.weight.lr", "optim.param_groups.blocks.0.conv.weight.lr",
             "optim.param_groups.head.bias.lr", "optim.state.fc.weight.exp_avg", "optim.state.fc.weight.step",
             "optim.state.blocks.0.conv.weight.exp_avg", "ema.fc.weight"]
    optimized, with_state = saved_optimizer_params(names)
    assert optimized == {"fc.weight", "blocks.0.conv.weight", "head.bias"}
    assert with_state == {"fc.weight", "blocks.0.conv.weight"}
