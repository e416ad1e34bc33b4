"""Any optimizer and schedule in an Experiment (issue 40, section 1), with real processes: an optimizer class of
the test's own (tests/own_optimizer_experiment.py: Lion) and a schedule given as a function of the step resume
exactly under ddp, fsdp and zero1 (stopped at step 5 of 12, resumed: the same losses, parameters and optimizer
state as an uninterrupted run), and the step runs eagerly, saying why."""

from pathlib import Path

import pytest

from tests.conftest import checkpoint_tensors, latest_checkpoint, run_hpctrain, same_params, train_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]


def train(run_dir: Path, strategy: str, *extra: str):
    result = run_hpctrain(["train", "own_optimizer_experiment:LionToy", "--nproc-per-node=2", f"run.dir={run_dir}",
                           f"dist.strategy={strategy}", *extra], 150)
    assert result.returncode == 0, result.output
    return result


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero1"])
def test_an_optimizer_and_schedule_of_the_experiments_own_resume_exactly(tmp_path: Path, strategy: str):
    straight = train(tmp_path / "straight", strategy)
    assert "step: eager" in straight.stderr
    train(tmp_path / "split", strategy, "train.stop_at_step=5")
    train(tmp_path / "split", strategy)
    losses = train_losses(tmp_path / "straight")
    assert sorted(losses) == list(range(1, 13)) and losses[12] < losses[1]
    assert train_losses(tmp_path / "split") == losses
    for part in ("model", "optim"):
        assert same_params(checkpoint_tensors(latest_checkpoint(tmp_path / "split"), part),
                           checkpoint_tensors(latest_checkpoint(tmp_path / "straight"), part)), part
    optim = checkpoint_tensors(latest_checkpoint(tmp_path / "straight"), "optim")
    assert any(k.endswith("exp_avg") for k in optim)  # Lion's own state is in the checkpoint
    # The schedule is the experiment's: 0.3 x 0.5 ** (step / 12), not the config's cosine.
    lrs = {r: v for r, v in _lrs(tmp_path / "straight").items()}
    assert lrs[1] == pytest.approx(0.3) and lrs[12] == pytest.approx(0.3 * 0.5 ** (11 / 12))


def _lrs(run_dir: Path) -> dict[int, float]:
    from tests.conftest import read_jsonl

    return {r["step"]: r["lr"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "train"}
