"""Invariants 1-3 of DESIGN.md with real processes (torchrun, gloo on CPU), each with a hard timeout."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hpctrain.experiments.digits.data import split_digits
from hpctrain.experiments.digits.model import MiniResNet
from tests.conftest import checkpoint_tensors, latest_checkpoint, read_jsonl, run_hpctrain, same_params, train_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

# A model without batch-dependent layers (GroupNorm), so a sample's gradient does not depend on its batch-mates.
SMALL = ["model.width=8", "model.norm=group", "train.global_batch_size=40", "train.micro_batch_size=10",
         "log.every_steps=1", "log.plots=false", "log.tensorboard=false"]


def train(run_dir: Path, nproc: int, *extra: str, timeout: float = 150):
    result = run_hpctrain(["train", "digits", f"run.dir={run_dir}", f"--nproc-per-node={nproc}", *SMALL, *extra], timeout)
    assert result.returncode == 0, result.output
    return result


def test_world_size_equivalence(tmp_path: Path):
    """(1 process, accumulation 4) = (2, 2) = (4, 1): same global batch, same losses at every step.

    The runs differ only in float summation order (about 3e-8 relative per step). The optimisation
    must be stable for that to stay small: at lr 3e-3 this width-8 net enters an unstable phase after
    ~10 steps that amplifies the rounding exponentially (measured: 2.5e-8 up to step 10, 2e-4 at step
    20), which says nothing about data order or reductions. Hence lr 1e-3 without warmup here."""
    runs = {}
    for nproc in (1, 2, 4):
        result = train(tmp_path / f"w{nproc}", nproc, "train.max_steps=20", "optim.lr=1e-3", "optim.warmup_steps=0")
        assert f"micro 10 x {nproc} ranks x {4 // nproc} accumulation" in result.stderr
        runs[nproc] = train_losses(tmp_path / f"w{nproc}")
    assert sorted(runs[1]) == list(range(1, 21))
    for nproc in (2, 4):
        assert sorted(runs[nproc]) == sorted(runs[1])
        for step, loss in runs[1].items():
            assert runs[nproc][step] == pytest.approx(loss, rel=1e-5), (nproc, step)
    # The losses must move, or agreeing would prove nothing.
    assert runs[1][20] < runs[1][1] - 0.1


def checkpoint_file(run_dir: Path, part: str = "model") -> dict:
    """The latest checkpoint's model or EMA weights by name."""
    return checkpoint_tensors(latest_checkpoint(run_dir), part)


# Batch norm, EMA, accumulation, augmentation and a loader worker all on.
EMA_RUN = ["model.norm=batch", "optim.ema_decay=0.9", "data.num_workers=1", "train.max_steps=16", "optim.warmup_steps=3"]


@pytest.fixture(scope="module")
def ema_straight(tmp_path_factory) -> Path:
    """16 steps in one go, with EMA: the reference of the resume test and the run the eval test validates."""
    run_dir = tmp_path_factory.mktemp("straight")
    train(run_dir, 2, *EMA_RUN)
    return run_dir


def test_resume_continues_the_same_run(tmp_path: Path, ema_straight: Path):
    """16 steps in one go = 8 steps, stop, fresh launch with --resume auto, 8 more: identical losses,
    parameters and EMA weights (the EMA is not in the losses or the parameters: it must be compared itself)."""
    train(tmp_path / "split", 2, *EMA_RUN, "train.stop_at_step=8")
    assert max(train_losses(tmp_path / "split")) == 8
    result = train(tmp_path / "split", 2, *EMA_RUN, "--resume", "auto")
    assert "resumed from" in result.stderr and "at step 8" in result.stderr

    straight, split = train_losses(ema_straight), train_losses(tmp_path / "split")
    assert sorted(split) == list(range(1, 17))
    assert split == straight  # exact equality: same world size, same arithmetic
    assert same_params(checkpoint_file(ema_straight), checkpoint_file(tmp_path / "split"))
    ema = checkpoint_file(tmp_path / "split", "ema")
    train_state = torch.load(latest_checkpoint(tmp_path / "split") / "train.pt", weights_only=True)
    assert train_state["ema_n_averaged"] == 16  # updated at every step, the 8 before the stop included
    assert same_params(checkpoint_file(ema_straight, "ema"), ema)
    # Validated on the EMA weights: rank 1 of the resumed run holds rank 0's saved copy of them, so this also needs
    # every rank to validate rank 0's batch-norm statistics, not its own.
    assert val_metrics(tmp_path / "split") == val_metrics(ema_straight) and 16 in val_metrics(ema_straight)


def val_metrics(run_dir: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["accuracy"]) for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "val"}


def digits_metrics(weights: dict) -> dict[str, float]:
    """Validation loss and accuracy of these weights, computed here in one batch, without hpctrain's loop."""
    model = MiniResNet(in_channels=1, num_classes=10, width=8, norm="batch")
    model.load_state_dict(weights)
    images, labels = split_digits(397)[1].tensors
    with torch.no_grad():
        logits = model.eval()(images)
    return {"loss": F.cross_entropy(logits, labels).item(), "accuracy": (logits.argmax(1) == labels).float().mean().item()}


def test_eval_validates_the_ema_weights(ema_straight: Path):
    """`hpctrain eval --resume PATH` of a run with EMA reports the EMA weights' metrics: those of the run's last
    validation (which the loop computes on the EMA weights), and not those of the raw weights."""
    latest = ema_straight / "checkpoints" / (ema_straight / "checkpoints" / "latest").read_text().strip()
    result = run_hpctrain(["eval", "digits", f"run.dir={ema_straight}", "--resume", str(latest), "--nproc-per-node=2",
                           *SMALL, *EMA_RUN], 150)
    assert result.returncode == 0, result.output
    printed = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    assert (printed["step"], printed["checkpoint"]) == (16, str(latest))
    assert (printed["loss"], printed["accuracy"]) == val_metrics(ema_straight)[16]  # same ranks, same sums

    ema = checkpoint_file(ema_straight, "ema")
    assert digits_metrics(ema)["loss"] == pytest.approx(printed["loss"], rel=1e-5)
    # The raw weights must give other numbers, or the checks above could not tell which weights eval used.
    assert digits_metrics(checkpoint_file(ema_straight))["loss"] != pytest.approx(printed["loss"], rel=1e-2)


def test_validation_is_exact_for_any_world_size(tmp_path: Path):
    """397 validation images (not divisible by 3): 1 and 3 processes report identical metrics."""
    run_dir = tmp_path / "run"
    train(run_dir, 1, "train.max_steps=5")
    metrics = {}
    for nproc in (1, 3):
        result = run_hpctrain(["eval", "digits", f"run.dir={run_dir}", f"--nproc-per-node={nproc}", *SMALL], 150)
        assert result.returncode == 0, result.output
        metrics[nproc] = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(metrics[1]) == 1 and metrics[1] == metrics[3]
    assert '"step": 5' in metrics[1][0]


def test_in_training_validation_with_batch_norm_is_that_of_the_checkpoint_on_3_processes(tmp_path: Path):
    """3 processes train with batch norm (each rank's running statistics are its own batches') and validate at
    the end: the logged metrics are those of the checkpointed model evaluated in one process here, so they do
    not depend on the world size. Without the buffer broadcast before validation they differ."""
    train(tmp_path, 3, "model.norm=batch", "train.global_batch_size=30", "train.max_steps=6", "optim.warmup_steps=0")
    logged = val_metrics(tmp_path)[6]
    expected = digits_metrics(checkpoint_file(tmp_path))
    assert logged[0] == pytest.approx(expected["loss"], rel=1e-5)
    assert logged[1] == pytest.approx(expected["accuracy"], abs=1e-6)
