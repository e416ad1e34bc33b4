"""Two processes (torchrun, gloo) with an asynchronous save every 10 steps, then a resume: every periodic save lands
and a run resumed from the stop step's (synchronous) save or from a periodic asynchronous one continues the same losses
as one that never stopped. The multi-process smoke test that CI also runs on the floor torch (make test-floor), where
the version-dependent paths differ (compat.py: the checkpoint stager, the control group's timeouts)."""

from pathlib import Path

import pytest

from tests.conftest import read_jsonl, run_hpctrain, train_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(700)]

COMMON = ["--nproc-per-node", "2", "log.plots=false", "log.tensorboard=false", "ckpt.every_steps=10",
          "ckpt.async_save=true", "ckpt.keep_last=10", "train.max_steps=40", "log.every_steps=5"]


def test_two_processes_save_asynchronously_at_every_interval_and_resume_the_same_run(tmp_path: Path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    one = run_hpctrain(["train", "digits", f"run.dir={whole}", *COMMON], 200)
    assert one.returncode == 0, one.output
    assert sorted(p.name for p in (whole / "checkpoints").glob("step_*")) == [
        f"step_{s:08d}" for s in (10, 20, 30, 40)], one.output

    first = run_hpctrain(["train", "digits", f"run.dir={split}", *COMMON, "train.stop_at_step=25"], 200)
    assert first.returncode == 0, first.output
    second = run_hpctrain(["train", "digits", f"run.dir={split}", *COMMON], 200)
    assert second.returncode == 0, second.output
    assert "resumed from" in second.stderr and "at step 25" in second.stderr, second.output
    assert train_losses(split) == train_losses(whole)  # gloo on CPU: exact (a log window ends at the stop step)
    val = [r for r in read_jsonl(split / "metrics.jsonl") if r["split"] == "val"]
    assert val and val[-1]["step"] == 40

    # the periodic saves are the asynchronous ones (a run's last save waits): resume from the third of them
    from_async = tmp_path / "from_async"
    third = run_hpctrain(["train", "digits", f"run.dir={from_async}", *COMMON,
                          f"ckpt.resume={whole / 'checkpoints' / 'step_00000030'}"], 200)
    assert third.returncode == 0, third.output
    assert "at step 30" in third.stderr, third.output
    after = {s: loss for s, loss in train_losses(whole).items() if s > 30}
    assert after and train_losses(from_async) == after
