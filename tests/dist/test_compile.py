"""torch.compile under DDP: checkpoints hold the plain module's names, so a compiled run resumes eagerly."""

from pathlib import Path

import pytest

from tests.conftest import run_hpctrain, train_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TOY = ["train", "toy_experiment:LinearToy", "--nproc-per-node", "2", "log.every_steps=1", "train.max_steps=6"]


def test_compiled_run_resumes_without_compile(tmp_path: Path):
    eager = run_hpctrain([*TOY, f"run.dir={tmp_path / 'eager'}"], 120)
    assert eager.returncode == 0, eager.output
    first = run_hpctrain([*TOY, f"run.dir={tmp_path / 'mixed'}", "train.compile=true", "train.stop_at_step=3"], 200)
    assert first.returncode == 0, first.output
    second = run_hpctrain([*TOY, f"run.dir={tmp_path / 'mixed'}"], 120)
    assert second.returncode == 0 and "resumed from" in second.stderr, second.output
    expected, got = train_losses(tmp_path / "eager"), train_losses(tmp_path / "mixed")
    assert sorted(got) == list(range(1, 7))
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), step
