"""The experiment protocol's newer parts, in one process: positional draws, tensor statistics, the outputs hook's
share/gather/images, the device-resident loader, old-style experiments."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import TensorDataset

from hpctrain.config.batch import batch_sizes
from hpctrain.config.schema import DataSection
from hpctrain.data.device_loader import DeviceLoader, dataset_tensors
from hpctrain.data.loader import build_loader
from hpctrain.data.positional import positional_randint, positional_randn
from hpctrain.data.sampler import EvalBatchSampler, StepBatchSampler
from hpctrain.dist.collectives import all_reduce_tensors
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.errors import UserError
from hpctrain.experiments.base import BatchInfo, Experiment, call_train_loss
from hpctrain.metrics.images import image_grid
from hpctrain.metrics.sinks import MetricsLogger, PngSink
from hpctrain.train.evaluate import evaluate
from hpctrain.experiments.outputs import Outputs, run_outputs
from hpctrain.train.precision import Precision

FP32 = Precision("fp32", None, "cpu")


def test_positional_draws_do_not_depend_on_the_slicing():
    """The numbers of a position are the same whether drawn whole or in any split, across block boundaries."""
    whole = positional_randn(0, 100, (3,), (7, 1), block=32, device="cpu")
    for cuts in ([0, 100], [0, 10, 33, 64, 65, 100], list(range(0, 101, 7)) + [100]):
        parts = [positional_randn(a, b - a, (3,), (7, 1), block=32, device="cpu") for a, b in zip(cuts, cuts[1:])]
        torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=0)
    assert not torch.equal(whole, positional_randn(0, 100, (3,), (7, 2), block=32, device="cpu"))  # parts matter
    ints = positional_randint(1000, 5, 20, (1,), block=16, device="cpu")
    assert ints.dtype == torch.int64 and ints.min() >= 0 and ints.max() < 1000 and len(set(ints.tolist())) > 10


def test_batch_info_train_draws_by_global_position():
    """A micro-batch's draws are the global batch's draws at its positions, for any split into ranks/micro-batches."""
    full = BatchInfo("train", step=3, start=0, total=16, seed=1).randn(16, 2, stream=1)
    quarter = BatchInfo("train", step=3, start=8, total=16, seed=1).randn(4, 2, stream=1)
    torch.testing.assert_close(quarter, full[8:12], rtol=0, atol=0)
    other_step = BatchInfo("train", step=4, start=0, total=16, seed=1).randn(16, 2, stream=1)
    assert not torch.equal(full, other_step)
    val_a = BatchInfo("val", step=10, start=300, total=1000, seed=1).rand(5)
    val_b = BatchInfo("val", step=99, start=296, total=1000, seed=1).rand(10)
    torch.testing.assert_close(val_a, val_b[4:9], rtol=0, atol=0)  # validation: same draws at every evaluation


class _Stats(Experiment):
    """eval_stats with a tensor statistic: a per-class count."""

    def build_model(self):
        return nn.Identity()

    def build_datasets(self):
        raise NotImplementedError

    def train_loss(self, model, batch):  # old style: no info
        return batch[0].float().mean()

    def eval_stats(self, model, batch, info):
        x, y = batch
        return {"count": torch.tensor(float(len(y))), "per_class": torch.bincount(y, minlength=4).float(),
                "first": torch.tensor(float(info.start))}

    def metrics(self, totals):
        return {"count": totals["count"], "per_class_2": float(totals["per_class"][2]), "firsts": totals["first"],
                "shape": float(totals["per_class"].numel())}


def _cfg():
    from hpctrain.config.load import load_config

    return load_config("x", _Stats.config_class)


def test_evaluate_sums_tensor_statistics_and_passes_positions():
    rt = single_process_runtime(torch.device("cpu"))
    y = torch.tensor([0, 1, 2, 2, 3, 2, 1])
    ds = TensorDataset(torch.zeros(7, 1), y)
    loader = build_loader(ds, EvalBatchSampler(7, 3, 0, 1), DataSection(num_workers=0), rt)
    got = evaluate(_Stats(_cfg()), nn.Identity(), loader, rt, FP32)
    assert got == {"count": 7.0, "per_class_2": 3.0, "firsts": 0.0 + 3 + 6, "shape": 4.0}


def test_evaluate_refuses_a_statistic_whose_shape_changes():
    class Ragged(_Stats):
        def eval_stats(self, model, batch, info):
            return {"per_class": torch.bincount(batch[1]).float()}  # no minlength: shape depends on the batch

    rt = single_process_runtime(torch.device("cpu"))
    ds = TensorDataset(torch.zeros(4, 1), torch.tensor([0, 1, 3, 0]))
    loader = build_loader(ds, EvalBatchSampler(4, 2, 0, 1), DataSection(num_workers=0), rt)
    with pytest.raises(UserError, match="same shape"):
        evaluate(Ragged(_cfg()), nn.Identity(), loader, rt, FP32)


def test_all_reduce_tensors_keeps_shapes_one_process():
    out = all_reduce_tensors({"a": torch.ones(2, 3), "b": torch.tensor(5.0)}, single_process_runtime(torch.device("cpu")))
    assert out["a"].shape == (2, 3) and out["a"].dtype == torch.float64 and float(out["b"]) == 5.0


def test_old_style_train_loss_still_called():
    info = BatchInfo("train", 0, 0, 2, 0)
    assert float(call_train_loss(_Stats(_cfg()), nn.Identity(), (torch.ones(2), None), info)) == 1.0


def test_outputs_share_gather_and_image(tmp_path: Path):
    rt = single_process_runtime(torch.device("cpu"))
    out = Outputs(rt, step=7, epoch=1, final=True, seed=3, run_dir=tmp_path, metrics=MetricsLogger([PngSink(tmp_path)]))
    assert out.share(10) == range(0, 10)
    torch.testing.assert_close(out.randn(range(2, 5), 3), out.randn(range(0, 10), 3)[2:5], rtol=0, atol=0)
    images = torch.rand(6, 3, 8, 8)
    path = out.image("grid", out.gather(images), nrow=3)
    assert path == tmp_path / "grid" / "step_0000007.png"
    with Image.open(path) as png:
        assert png.size == (3 * 10 + 2, 2 * 10 + 2) and png.mode == "RGB"
    assert not list(tmp_path.glob("grid/.*"))  # no temporary file left behind

    calls = []

    class Hook(_Stats):
        def outputs(self, model, out):
            calls.append((model.training, torch.is_grad_enabled()))

    model = nn.Linear(1, 1).train()
    run_outputs(Hook(_cfg()).outputs, model, out)
    assert calls == [(False, False)] and model.training  # eval mode, no grad, mode restored


def test_outputs_share_splits_evenly_for_any_world():
    from dataclasses import replace

    rt = single_process_runtime(torch.device("cpu"))
    for world in (1, 2, 3, 7):
        shares = [Outputs(replace(rt, rank=r, world_size=world), 0, 0, False, 0, Path("."), MetricsLogger([])).share(10)
                  for r in range(world)]
        assert [i for s in shares for i in s] == list(range(10))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_image_grid_checks_its_input():
    assert image_grid(torch.rand(4, 1, 5, 5)).shape == (2 * 7 + 2, 2 * 7 + 2, 1)
    with pytest.raises(ValueError, match="floats"):
        image_grid(torch.zeros(4, 3, 5, 5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="C 1 or 3"):
        image_grid(torch.rand(4, 2, 5, 5))


def test_device_loader_cuts_the_loaders_batches():
    """data.on_device: the same micro-batches, in the same order, as the loader path, for every rank."""
    n = 40
    ds = TensorDataset(torch.arange(n * 2).view(n, 2), torch.arange(n))
    for world in (1, 2):
        plan = batch_sizes(8, 2, world)
        for rank in range(world):
            rt = single_process_runtime(torch.device("cpu"))
            s1, s2 = StepBatchSampler(n, plan, rank, seed=5), StepBatchSampler(n, plan, rank, seed=5)
            s1.set_position(1, 2), s2.set_position(1, 2)
            loader = build_loader(ds, s1, DataSection(num_workers=0), rt)
            device = DeviceLoader(dataset_tensors(ds, "x"), s2, torch.device("cpu"), seed=5, transform=None, draws=1)
            want, got = list(loader), list(device)
            assert len(got) == len(want) == len(device)
            for a, b in zip(want, got):
                assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_device_loader_augment_draws_per_sample_not_per_rank():
    n = 16
    ds = TensorDataset(torch.arange(n))
    seen = {}
    for world in (1, 2):
        for rank in range(world):
            s = StepBatchSampler(n, batch_sizes(8, 4, world), rank, seed=1)
            s.set_position(0, 0)
            loader = DeviceLoader(ds.tensors, s, torch.device("cpu"), 1, lambda b, u: (b[0], u[:, 0]), draws=1)
            for index, u in loader:
                for i, v in zip(index.tolist(), u.tolist()):
                    assert seen.setdefault(i, v) == v
    assert len(seen) == n


def test_device_loader_needs_tensors():
    with pytest.raises(UserError, match="TensorDataset"):
        dataset_tensors([1, 2, 3], "myexp")


def test_png_sink_writes_numpy_grid(tmp_path: Path):
    path = PngSink(tmp_path).write_image("a/b", 12, np.zeros((4, 5, 3), np.uint8))
    assert path.name == "step_0000012.png" and Image.open(path).size == (5, 4)


class _Counter:
    """Experiment state: what a checkpoint's train.pt holds under "experiment"."""

    def __init__(self, seen: int = 0) -> None:
        self.seen = seen

    def state_dict(self):
        return {"seen": self.seen, "histogram": torch.arange(3.0) * self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]
        assert torch.equal(state["histogram"], torch.arange(3.0) * self.seen)


def test_experiment_state_round_trips_through_a_checkpoint(tmp_path: Path, caplog):
    from hpctrain.checkpoint.manager import Checkpointer
    from hpctrain.train.state import TrainState
    from tests.unit.test_async_checkpoint import training_state

    rt = single_process_runtime(torch.device("cpu"))
    rng = {"python": None}
    saved = training_state(1)
    saved["experiment"] = _Counter(seen=7)
    Checkpointer(tmp_path, "toy", rt, "x = 1\n", 3).save(TrainState(step=1, global_batch_size=8).to_dict(), saved, rng,
                                                     wait=True)
    fresh = training_state(0)
    fresh["experiment"] = _Counter()
    Checkpointer(tmp_path, "toy", rt, "x = 1\n", 3).restore("auto", fresh)
    assert fresh["experiment"].seen == 7
    # A checkpoint without experiment state (an older version of the experiment): it starts fresh, with a warning.
    del saved["experiment"]
    Checkpointer(tmp_path / "old", "toy", rt, "x = 1\n", 3).save(TrainState(step=1, global_batch_size=8).to_dict(), saved,
                                                              rng, wait=True)
    fresh["experiment"] = _Counter()
    Checkpointer(tmp_path / "old", "toy", rt, "x = 1\n", 3).restore("auto", fresh)
    assert fresh["experiment"].seen == 0 and "holds no experiment state" in caplog.text


def test_ema_matches_torch_averaged_model_bit_for_bit():
    """hpctrain's EMA (no per-step host-to-device copy) computes what AveragedModel + get_ema_multi_avg_fn does."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from hpctrain.train.ema import EMA

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ours, theirs = EMA(model, 0.9), AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for _ in range(4):
        model(torch.randn(8, 4)).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        ours.update_parameters(model)
        theirs.update_parameters(model)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert int(a["n_averaged"]) == 4 and not torch.equal(a["module.0.weight"], model[0].weight)


def test_old_artifacts_hook_is_flagged():
    with pytest.warns(UserWarning, match="artifacts"):
        class Old(_Stats):
            def artifacts(self, model, out_dir):
                pass


def test_outputs_due_by_steps_by_epochs_and_at_the_end():
    from types import SimpleNamespace

    from hpctrain.train.loop import outputs_due

    class Hook(_Stats):
        def outputs(self, model, out):
            pass

    def due(experiment, step, epoch, epoch_ended, every_steps=0, every_epochs=0):
        log = SimpleNamespace(outputs_every_steps=every_steps, outputs_every_epochs=every_epochs)
        ctx = SimpleNamespace(experiment=experiment, state=SimpleNamespace(step=step, epoch=epoch), total_steps=100,
                              cfg=SimpleNamespace(log=log))
        return outputs_due(ctx, epoch_ended)

    hook = Hook(_cfg())
    assert due(hook, 100, 9, False) and not due(hook, 99, 9, False)  # the end, always
    assert due(hook, 30, 1, False, every_steps=10) and not due(hook, 31, 1, False, every_steps=10)
    assert due(hook, 40, 2, True, every_epochs=2) and not due(hook, 20, 1, True, every_epochs=2)
    assert not due(hook, 40, 2, False, every_epochs=2)  # not mid-epoch
    assert not due(_Stats(_cfg()), 100, 9, False)  # no hook: nothing, not even its barrier


def test_on_device_refuses_an_experiment_that_augments_only_on_the_host():
    from hpctrain.config.load import load_config
    from hpctrain.experiments.digits import DigitsExperiment
    from hpctrain.train.run import _train_loader

    cfg = load_config("digits", DigitsExperiment.config_class, experiment_defaults=DigitsExperiment.defaults,
                      overrides=["data.on_device=true"])
    data = DigitsExperiment(cfg).build_datasets()
    sampler = StepBatchSampler(len(data.train), batch_sizes(100, 25, 1), 0, seed=0)
    with pytest.raises(UserError, match="device_transform"):
        _train_loader(cfg, single_process_runtime(torch.device("cpu")), data, sampler)
    no_augment = load_config("digits", DigitsExperiment.config_class, experiment_defaults=DigitsExperiment.defaults,
                             overrides=["data.on_device=true", "data.augment=false"])
    assert isinstance(_train_loader(no_augment, single_process_runtime(torch.device("cpu")), data, sampler), DeviceLoader)
