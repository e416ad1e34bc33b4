"""Losses over tokens, exact for any micro-batch (issue 40, section 4; DESIGN invariant 10), with real processes: a
variable-length sequence model (tests/token_experiment.py) whose loss is given as (sum, count) gives the same losses
and gradient norms (1e-6 relative) for micro-batch 1, 2 and 4 on 1 and 2 processes, as an Experiment, as a
StepExperiment and in a loop of its own; the mean per micro-batch does not (so the test can tell)."""

from pathlib import Path

import pytest

from tests.conftest import TESTS, final_params, read_jsonl, run_hpctrain, run_module

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]


def records(run_dir: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_jsonl(run_dir / "metrics.jsonl")
            if r["split"] == "train"}


def train(run_dir: Path, experiment: str, micro: int, nproc: int, *extra: str) -> dict[int, tuple[float, float]]:
    result = run_hpctrain(["train", f"token_experiment:{experiment}", f"--nproc-per-node={nproc}",
                           f"train.micro_batch_size={micro}", f"run.dir={run_dir}", *extra], 150)
    assert result.returncode == 0, result.output
    return records(run_dir)


def same(a: dict, b: dict, rel: float = 1e-6) -> bool:
    return a.keys() == b.keys() and all(x == pytest.approx(y, rel=rel) for k in a for x, y in zip(a[k], b[k]))


@pytest.fixture(scope="module")
def experiment_runs(tmp_path_factory) -> dict[tuple[int, int], Path]:
    root = tmp_path_factory.mktemp("tokens")
    runs = {(micro, nproc): root / f"m{micro}_p{nproc}" for micro in (1, 2, 4) for nproc in (1, 2)}
    for (micro, nproc), run_dir in runs.items():
        train(run_dir, "TokenLM", micro, nproc)
    return runs


def test_a_sum_over_count_loss_is_the_same_for_any_micro_batch_and_world_size(experiment_runs):
    reference = records(experiment_runs[(1, 1)])
    assert sorted(reference) == list(range(1, 7)) and reference[6][0] < reference[1][0]
    for key, run_dir in experiment_runs.items():
        assert same(records(run_dir), reference), key
    params = final_params(experiment_runs[(1, 1)])
    other = final_params(experiment_runs[(4, 2)])
    assert all(other[k].allclose(params[k], rtol=1e-6, atol=1e-12) for k in params)


def test_the_mean_per_micro_batch_depends_on_the_split(tmp_path: Path, experiment_runs):
    """The gradient-accumulation bug the (sum, count) form avoids: the same data, another split, other numbers."""
    one = train(tmp_path / "a", "TokenLM", 1, 1, "model.mean=true")
    four = train(tmp_path / "b", "TokenLM", 4, 2, "model.mean=true")
    assert not same(one, four, rel=1e-4)
    assert not same(one, records(experiment_runs[(1, 1)]), rel=1e-4)


def test_a_step_and_a_loop_of_ones_own_give_the_same_exact_token_losses(tmp_path: Path, experiment_runs):
    reference = records(experiment_runs[(1, 1)])
    for micro, nproc in ((1, 2), (4, 1)):
        assert same(train(tmp_path / f"step{micro}{nproc}", "TokenStep", micro, nproc), reference), (micro, nproc)
    for micro, nproc in ((2, 2), (4, 1)):
        run_dir = tmp_path / f"loop{micro}{nproc}"
        # under plain torchrun: the script's own key=value arguments are the session's overrides
        result = run_module("torch.distributed.run", ["--standalone", f"--nproc-per-node={nproc}",
                                                      str(TESTS / "token_loop.py"), f"train.micro_batch_size={micro}",
                                                      f"run.dir={run_dir}"], 150)
        assert result.returncode == 0, result.output
        assert same(records(run_dir), reference), (micro, nproc)
