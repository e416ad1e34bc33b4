"""DDPM with real processes (torchrun, gloo on CPU): per-sample noise independent of the world size, in training
and validation, from the loader and from data.on_device; the loss falls; a resume reproduces losses and EMA."""

from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import checkpoint_tensors, latest_checkpoint, read_jsonl, run_hpctrain, train_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config", str(ROOT / "configs" / "ddpm_cifar10_tiny.toml"), "log.every_steps=1", "log.plots=false",
        "log.tensorboard=false", "log.outputs_every_steps=0", "ckpt.every_steps=0", "data.num_workers=0"]


def train(run_dir: Path, nproc: int, *extra: str, timeout: float = 180):
    result = run_hpctrain(["train", "ddpm_cifar10", *TINY, f"run.dir={run_dir}", f"--nproc-per-node={nproc}", *extra],
                          timeout)
    assert result.returncode == 0, result.output
    return result


def val_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "val"]


def assert_same_run(a: Path, b: Path, steps: int) -> None:
    la, lb = train_losses(a), train_losses(b)
    assert sorted(la) == sorted(lb) == list(range(1, steps + 1))
    for step, loss in la.items():
        assert lb[step] == pytest.approx(loss, rel=1e-5), step
    va, vb = val_records(a), val_records(b)
    assert [r["step"] for r in va] == [r["step"] for r in vb] and va
    for ra, rb in zip(va, vb):
        for key in ("loss", "loss_t0", "loss_t3"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5), (ra["step"], key)


def test_world_size_invariance_train_and_val(tmp_path: Path):
    """(processes x accumulation) 1x4 = 2x2 = 4x1: the timesteps and noise of each sample come from its position
    in the global batch, so the losses agree at every step; so do the validation losses (drawn per validation
    sample; with 4 ranks, two hold no validation batch and still join the sums, tensors included)."""
    # train.channels_last=auto: its collective (rank 0 inspects the model for all) runs on 2 and 4 ranks too.
    common = ("train.max_steps=20", "eval.every_steps=10", "model.flip=false", "train.channels_last=auto")
    for nproc in (1, 2, 4):
        result = train(tmp_path / f"w{nproc}", nproc, *common)
        assert f"micro 4 x {nproc} ranks x {4 // nproc} accumulation" in result.stderr
        assert "layout: NCHW (train.channels_last=auto: on cpu, not CUDA)" in result.stderr
    for nproc in (2, 4):
        assert_same_run(tmp_path / "w1", tmp_path / f"w{nproc}", 20)
    losses = train_losses(tmp_path / "w1")
    assert losses[20] < losses[1] - 0.05  # they moved: agreeing would prove nothing otherwise


def test_on_device_data_matches_loader_and_world_size(tmp_path: Path):
    """data.on_device cuts the same micro-batches as the loader (augmentation off: the two draw flips differently);
    with its batched flip on, 1 and 2 processes still agree."""
    common = ("train.max_steps=8", "eval.every_steps=8")
    train(tmp_path / "loader", 1, *common, "model.flip=false")
    train(tmp_path / "device", 1, *common, "model.flip=false", "data.on_device=true")
    assert_same_run(tmp_path / "loader", tmp_path / "device", 8)
    train(tmp_path / "flip1", 1, *common, "data.on_device=true")
    train(tmp_path / "flip2", 2, *common, "data.on_device=true")
    assert_same_run(tmp_path / "flip1", tmp_path / "flip2", 8)
    assert train_losses(tmp_path / "flip1") != train_losses(tmp_path / "device")  # the flips did something


def test_loss_falls_and_outputs_are_images(tmp_path: Path):
    """50 steps on 2 processes: the loss falls; the sample grid and the denoising strip are valid PNGs of the
    configured layout, written at the output steps and at the end."""
    run_dir = tmp_path / "run"
    train(run_dir, 2, "train.max_steps=50", "log.outputs_every_steps=25", "optim.lr=1e-3")
    losses = train_losses(run_dir)
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(46, 51)) / 5
    assert last < 0.7 * first, (first, last)
    for tag in ("samples", "denoising"):
        files = sorted((run_dir / "images" / tag).glob("*.png"))
        assert [f.name for f in files] == ["step_0000025.png", "step_0000050.png"], tag
        with Image.open(files[-1]) as image:
            image.verify()
    with Image.open(run_dir / "images" / "denoising" / "step_0000050.png") as strip:
        # 4 rows x 6 columns of 16-pixel images with 2-pixel padding (torchvision's make_grid)
        assert strip.size == (6 * 18 + 2, 4 * 18 + 2)
    outputs = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "outputs"]
    assert [r["step"] for r in outputs] == [25, 50]


def test_resume_reproduces_losses_and_ema(tmp_path: Path):
    """Stopped at step 10 and resumed on another world size: the same losses and the same EMA weights as 20 steps
    in one go (per-sample noise does not come from the ranks' streams, and dropout is 0 in the tiny config)."""
    common = ("train.max_steps=20", "eval.every_steps=10", "optim.ema_decay=0.9")
    train(tmp_path / "straight", 2, *common)
    train(tmp_path / "split", 2, *common, "train.stop_at_step=10")
    train(tmp_path / "split", 1, *common)
    assert_same_run(tmp_path / "straight", tmp_path / "split", 20)
    a, b = (checkpoint_tensors(latest_checkpoint(tmp_path / name), "ema") for name in ("straight", "split"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)


