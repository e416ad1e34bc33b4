"""A trainable parameter that never gets a gradient (a head the loss does not use) has no optimizer state, so its
checkpoint names none for it: a resume, under any strategy and size, loads the rest and leaves it stateless, as in
the uninterrupted run (it used to stop with "Missing key in checkpoint state_dict: optim.state.unused...")."""

from pathlib import Path

import pytest

from tests.conftest import run_hpctrain, train_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

TOY = ["toy_experiment:LinearToy", "model.unused_head=true", "train.max_steps=8", "log.every_steps=1",
       "train.global_batch_size=32", "train.micro_batch_size=8", "optim.warmup_steps=0", "eval.every_steps=0",
       "dist.find_unused_parameters=true"]  # DDP needs it for a parameter without a gradient


def train(run_dir: Path, nproc: int, *extra: str):
    result = run_hpctrain(["train", *TOY, f"run.dir={run_dir}", f"--nproc-per-node={nproc}", *extra], 150)
    assert result.returncode == 0, result.output
    return result


def test_a_parameter_without_gradients_resumes_under_every_strategy(tmp_path: Path):
    train(tmp_path / "straight", 1)
    run = tmp_path / "run"
    # Each launch resumes the one before: fsdp into fsdp (DTensor state), fsdp into zero1 (partitions), then one
    # process. (DDP, with find_unused_parameters and its gradients as bucket views, hands the unused parameters zero
    # gradients, so under ddp and zero1 they get optimizer state: a checkpoint of theirs holds it.)
    for nproc, strategy, stop in [(2, "fsdp", 2), (2, "fsdp", 4), (2, "zero1", 6), (1, "ddp", 0)]:
        result = train(run, nproc, f"dist.strategy={strategy}", *([f"train.stop_at_step={stop}"] if stop else []))
        if stop in (4, 6):
            assert "holds no optimizer state for 2 parameter(s) that never had a gradient (unused.bias, " \
                   "unused.weight)" in result.stderr
    got, want = train_losses(run), train_losses(tmp_path / "straight")
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_without_find_unused_parameters_the_failure_says_what_to_set(tmp_path: Path):
    """The same model trains on one process (no DDP); on two, DDP's error ends in advice about
    TORCH_DISTRIBUTED_DEBUG. The run ends with one line naming the setting."""
    args = [a for a in TOY if a != "dist.find_unused_parameters=true"]
    result = run_hpctrain(["train", *args, f"run.dir={tmp_path}", "--nproc-per-node=2"], 150)
    assert result.returncode == 2, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hpctrain: worker rank") and "set dist.find_unused_parameters=true" in last, last
    assert "TORCH_DISTRIBUTED_DEBUG" not in last
