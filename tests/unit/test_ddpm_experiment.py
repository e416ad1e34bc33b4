"""The DDPM experiments in one process: configs, data sources in their real on-disk format, augmentation, the
denoising strip's timesteps, samples' shape and range."""

from pathlib import Path

import pytest
import torch

from hpctrain.config.load import load_config
from hpctrain.datasets.fixtures import make_cifar10
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.errors import UserError
from hpctrain.experiments.ddpm.experiment import DDPMCifar10, DDPMDigits, _flip_batch, _flip_sample
from hpctrain.experiments.ddpm.sampling import draw_samples, strip_timesteps
from hpctrain.metrics.sinks import MetricsLogger
from hpctrain.experiments.outputs import Outputs

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "ddpm_cifar10_tiny.toml"


def experiment(cls=DDPMCifar10, config=TINY, *overrides: str):
    cfg = load_config(cls.name, cls.config_class, experiment_defaults=cls.defaults, config_file=config,
                      overrides=list(overrides))
    return cls(cfg)


def test_reference_config_is_the_reference_run():
    """ddpm_cifar10's defaults are the source's run: 100 epochs, 64 x 6 = 384, Adam 2e-4, 5k warm-up, clip 1,
    dropout 0.1, flip, EMA 0.9999; 35.7M parameters."""
    exp = experiment(DDPMCifar10, None)
    c = exp.cfg
    assert (c.train.epochs, c.train.micro_batch_size, c.train.global_batch_size) == (100, 64, 384)
    assert (c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay, c.optim.schedule) == (2e-4, 5000, 0.0, "constant")
    assert (c.train.grad_clip, c.optim.ema_decay, exp.options.dropout, exp.options.flip) == (1.0, 0.9999, 0.1, True)
    assert exp.options.timesteps == 1000 and exp.diffusion.betas[0] == pytest.approx(1e-4)
    assert sum(p.numel() for p in exp.build_model().parameters()) == 35_746_307
    shipped = load_config("ddpm_cifar10", DDPMCifar10.config_class, experiment_defaults=DDPMCifar10.defaults,
                          config_file=ROOT / "configs" / "ddpm_cifar10.toml")
    assert shipped == c  # the TOML file spells out the same run


def test_digits_config_model_size():
    exp = experiment(DDPMDigits, None)
    assert sum(p.numel() for p in exp.build_model().parameters()) == 1_112_801
    train, val = exp.build_datasets().train, exp.build_datasets().val
    assert train.tensors[0].shape[1:] == (1, 16, 16) and train.tensors[0].dtype == torch.uint8
    assert len(train) == 1400 and len(val) == 397


def test_cifar10_source_reads_the_official_layout(tmp_path: Path):
    make_cifar10(tmp_path, per_batch=6, test=5)
    exp = experiment(DDPMCifar10, TINY, "model.source=cifar10", f"model.data_root={tmp_path}")
    data = exp.build_datasets()
    assert len(data.train) == 30 and len(data.val) == 5
    assert data.train.tensors[0].shape == (30, 3, 32, 32) and data.train.tensors[0].dtype == torch.uint8


def test_missing_cifar10_says_where_to_put_it(tmp_path: Path):
    exp = experiment(DDPMCifar10, TINY, "model.source=cifar10", f"model.data_root={tmp_path}")
    with pytest.raises(UserError, match="CIFAR-10 not found"):
        exp.build_datasets()


def test_missing_shards_say_how_to_write_them(tmp_path: Path):
    exp = experiment(DDPMCifar10, TINY, "model.source=shards", f"model.data_root={tmp_path}")
    with pytest.raises(UserError, match="hpctrain shard"):
        exp.build_datasets()


@pytest.mark.parametrize("override, message", [
    ("model.norm_groups=5", "norm_groups"),
    ("model.image_size=17", "divisible"),
    ("model.sample_steps=1000", "sample_steps"),
    ("model.strip_samples=-1", "strip_samples"),
])
def test_bad_options_are_refused(override: str, message: str):
    with pytest.raises(UserError, match=message):
        experiment(DDPMCifar10, TINY, override)


def test_fewer_samples_than_strip_rows_is_no_error():
    """`hpctrain sample RUN --n 2` sets model.samples=2 only: the strip (more rows by default) shows the 2 drawn."""
    from hpctrain.experiments.ddpm.sampling import strip_rows

    exp = experiment(DDPMCifar10, TINY, "model.samples=2")
    assert exp.options.strip_samples > 2 and strip_rows(exp.options.samples, exp.options.strip_samples) == 2
    assert strip_rows(64, 8) == 8 and strip_rows(64, 0) == 0


def test_flip_paths_flip():
    image = torch.arange(12, dtype=torch.uint8).view(1, 3, 4)
    flipped = [torch.equal(_flip_sample((image, 0), torch.Generator().manual_seed(s))[0], image.flip(-1))
               for s in range(20)]
    assert any(flipped) and not all(flipped)
    batch = torch.stack([image, image])
    out = _flip_batch((batch, None), torch.tensor([[0.2], [0.8]]))[0]
    assert torch.equal(out[0], image.flip(-1)) and torch.equal(out[1], image)


def test_strip_timesteps():
    assert strip_timesteps(1000, 10) == [999, 874, 749, 624, 500, 375, 250, 125, 0, -1]
    assert strip_timesteps(100, 2) == [99, -1]


def test_samples_have_shape_range_and_are_deterministic(tmp_path: Path):
    exp = experiment()
    torch.manual_seed(0)
    model = exp.build_model().eval()
    out = Outputs(single_process_runtime(torch.device("cpu")), 0, 0, True, 7, tmp_path, MetricsLogger([]))
    x0, recorded, mine = draw_samples(exp, model, out, 3, 5, (99, 0, -1))
    again, _, _ = draw_samples(exp, model, out, 3, 5, ())
    assert x0.shape == (3, 3, 16, 16) and torch.isfinite(x0).all() and x0.abs().max() <= 1
    assert torch.equal(x0, again) and mine == range(3)
    assert set(recorded) == {99, 0, -1}


@pytest.mark.parametrize("on_device", [False, True])
def test_shards_source_reads_hpctrain_shards(tmp_path: Path, on_device: bool):
    """`hpctrain shard --format cifar10` output, read as the ddpm source (per sample, or decoded once for
    data.on_device)."""
    from tests.conftest import run_hpctrain

    make_cifar10(tmp_path / "src", per_batch=4, test=3)
    result = run_hpctrain(["shard", str(tmp_path / "src"), str(tmp_path / "shards"), "--format", "cifar10"], 120)
    assert result.returncode == 0, result.output
    exp = experiment(DDPMCifar10, TINY, "model.source=shards", f"model.data_root={tmp_path / 'shards'}",
                     f"data.on_device={str(on_device).lower()}")
    data = exp.build_datasets()
    assert len(data.train) == 20 and len(data.val) == 3
    image, label = data.train[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8 and 0 <= int(label) < 10
    assert hasattr(data.train, "tensors") == on_device


def test_plan_measures_an_experiment_that_draws_per_sample():
    """`hpctrain plan` times a step through the same train_loss call as the loop (with BatchInfo)."""
    from tests.conftest import run_hpctrain

    result = run_hpctrain(["plan", "ddpm_cifar10", "--config", str(TINY), "--nodes", "2", "--gpus-per-node", "2",
                           "--busbw", "10", "--steps", "1", "--json", "train.global_batch_size=32"], 120)
    assert result.returncode == 0, result.output


def test_sampling_in_chunks_and_with_nothing_to_draw(tmp_path: Path):
    """model.sample_batch only changes how many samples go through the model at once, not the samples; a rank
    with no share (fewer samples than ranks) returns empty tensors under the same strip keys as the others."""
    from dataclasses import replace

    torch.manual_seed(0)
    whole, chunked = experiment(), experiment(DDPMCifar10, TINY, "model.sample_batch=2")
    model = whole.build_model().eval()
    rt = single_process_runtime(torch.device("cpu"))
    out = Outputs(rt, 0, 0, True, 7, tmp_path, MetricsLogger([]))
    a, rec_a, _ = draw_samples(whole, model, out, 5, 4, (99, -1), record_rows=3)
    b, rec_b, _ = draw_samples(chunked, model, out, 5, 4, (99, -1), record_rows=3)
    # Another batch size may take another convolution kernel: on one of these 2-core VMs one of 3,840 values differed by
    # 1.4e-6 after 4 denoising steps. A sampler that mixed up samples or steps differs by far more.
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert list(rec_a) == list(rec_b) == [99, -1] and rec_b[99].shape[0] == 3 and rec_b[-1].shape[0] == 3
    idle = Outputs(replace(rt, rank=0, world_size=4), 0, 0, True, 7, tmp_path, MetricsLogger([]))
    x0, rec, mine = draw_samples(whole, model, idle, 3, 4, (99, -1), record_rows=3)
    assert len(mine) == 0 and x0.shape == (0, 3, 16, 16) and list(rec) == [99, -1] and rec[99].shape[0] == 0
