"""A resume with changed optimizer settings runs with them from the resumed step, under every strategy: the config
wins for hyper-parameters, the checkpoint keeps the state (train/resume_settings.py). They used to be recorded in
config.toml and ignored: the checkpoint's param_groups and the scheduler's base rates overrode them."""

from pathlib import Path

import pytest

from hpctrain.config.schema import OptimSection
from hpctrain.train.optim import lr_factor
from tests.conftest import checkpoint_tensors, read_jsonl, run_hpctrain, same_params

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

SMALL = ["model.width=8", "model.norm=group", "train.global_batch_size=32", "train.micro_batch_size=16",
         "log.every_steps=1", "log.plots=false", "log.tensorboard=false", "ckpt.keep_last=5",
         "optim.warmup_steps=2", "optim.schedule=linear", "eval.every_steps=0"]


def train(run_dir: Path, *extra: str):
    result = run_hpctrain(["train", "digits", f"run.dir={run_dir}", *SMALL, *extra], 200)
    assert result.returncode == 0, result.output
    return result


def lrs(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "train"}


@pytest.mark.parametrize("nproc,strategy", [(1, "ddp"), (2, "zero1"), (2, "fsdp")])
def test_a_changed_learning_rate_drives_the_resumed_steps(tmp_path: Path, nproc: int, strategy: str):
    """optim.lr near 0 from step 6 on: the weights stop moving, under each strategy's optimizer state dict (zero1's
    partitions, fsdp's shards). With the checkpoint's rate they moved on at the old schedule's 0.003 x ..."""
    common = [f"--nproc-per-node={nproc}", f"dist.strategy={strategy}"]
    train(tmp_path, *common, "train.max_steps=6")
    resumed = train(tmp_path, *common, "train.max_steps=10", "optim.lr=1e-30")
    assert "optim.lr: 0.003 -> 1e-30 from step 6" in resumed.stderr, resumed.output
    assert all(lrs(tmp_path)[s] <= 1e-30 for s in range(7, 11))
    at_stop, at_end = (checkpoint_tensors(tmp_path / "checkpoints" / f"step_{s:08d}") for s in (6, 10))
    assert same_params(at_stop, at_end)  # float32 weights do not move by 1e-30 x an Adam step


def test_a_longer_run_with_a_new_schedule_continues_it_at_the_resumed_step(tmp_path: Path):
    """train.max_steps 6 -> 12 with another lr, schedule and warm-up: the first resumed step runs at the new
    schedule's rate for step 6 of 12 (not the old linear schedule's end, 0), and config.toml says what runs."""
    train(tmp_path, "train.max_steps=6")
    new = OptimSection(lr=0.01, warmup_steps=8, schedule="cosine")
    resumed = train(tmp_path, "train.max_steps=12", "optim.lr=0.01", "optim.warmup_steps=8", "optim.schedule=cosine")
    for line in ("optim.schedule: 'linear' -> 'cosine' from step 6", "train.max_steps: 6 -> 12 from step 6",
                 "optim.warmup_steps: 2 -> 8 from step 6"):
        assert line in resumed.stderr, resumed.output
    logged = lrs(tmp_path)
    assert logged[6] == pytest.approx(0.003 * lr_factor(5, 6, OptimSection(lr=0.003, warmup_steps=2, schedule="linear")))
    for step in range(7, 13):  # a record's lr is the rate its step ran at: step - 1, 0-based
        assert logged[step] == pytest.approx(0.01 * lr_factor(step - 1, 12, new), rel=1e-12), step
    assert "lr = 0.01" in (tmp_path / "config.toml").read_text()


def test_a_changed_optimizer_is_refused_before_launch(tmp_path: Path):
    train(tmp_path, "train.max_steps=2")
    refused = run_hpctrain(["train", "digits", f"run.dir={tmp_path}", *SMALL, "train.max_steps=4", "optim.name=sgd"],
                           120)
    assert refused.returncode == 2, refused.output
    assert "optim.name changed" in refused.stderr and "optim.name=adamw" in refused.stderr, refused.output


def test_an_ema_turned_on_at_a_resume_starts_from_the_restored_weights_under_fsdp(tmp_path: Path):
    """optim.ema_decay 0 -> 0.9 at a resume (the README: a changed ema_decay applies from the resumed step): it
    failed on every rank ('has no EMA weights'). The EMA starts from the restored, sharded weights; with a near-zero
    rate the weights stay, so the EMA saved at the end equals them exactly."""
    common = ["--nproc-per-node=2", "dist.strategy=fsdp"]
    train(tmp_path, *common, "train.max_steps=6", "optim.ema_decay=0")
    resumed = train(tmp_path, *common, "train.max_steps=8", "optim.ema_decay=0.9", "optim.lr=1e-30")
    assert "the EMA starts from the restored weights at step 6" in resumed.stderr, resumed.output
    end = tmp_path / "checkpoints" / "step_00000008"
    assert same_params(checkpoint_tensors(end, "ema"), checkpoint_tensors(end))
