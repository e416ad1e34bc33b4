"""Bring your own training, levels 2 and 3 (issue 40) with real processes: a small GAN (batch norm in both models,
two Adam optimizers, an EMA of the generator; tests/gan_experiment.py) as a StepExperiment under `hpctrain train`
and as a loop of its own under hpctrain.session (tests/gan_loop.py, run by `hpctrain train gan_loop.py`).

1 x 4, 2 x 2 and 4 x 1 processes x accumulation give the same losses; a SIGTERM to one rank mid-epoch gives one
checkpoint and exit 75, and the resume equals the uninterrupted run (losses, parameters, EMA); the same under fsdp;
a resume on another number of processes continues the same losses. Both levels do the same arithmetic, so their
runs are compared with each other too (which spares repeating every configuration at both levels)."""

import shutil
from pathlib import Path

import pytest

from tests.conftest import TESTS, checkpoint_tensors, latest_checkpoint, read_jsonl, run_hpctrain, same_params

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

STOP = "signal:rank=1:step=3:signal=SIGTERM"  # lands in step 4 on rank 1; every rank stops at step 5 (of 8 an epoch)


def level2(run_dir: Path, nproc: int, *extra: str, fault: str = "", expect: int = 0):
    result = run_hpctrain(["train", "gan_experiment:GanStep", f"--nproc-per-node={nproc}", f"run.dir={run_dir}",
                           *extra], 200, env={"HPCTRAIN_FAULT": fault} if fault else None)
    assert result.returncode == expect, result.output
    return result


def level3(run_dir: Path, nproc: int, *extra: str, fault: str = "", expect: int = 0):
    """The loop as `hpctrain train gan_loop.py` runs it: its settings reach the session through HPCTRAIN_SETTINGS."""
    result = run_hpctrain(["train", str(TESTS / "gan_loop.py"), f"--nproc-per-node={nproc}", f"run.dir={run_dir}",
                           *extra], 200, env={"HPCTRAIN_FAULT": fault} if fault else None)
    assert result.returncode == expect, result.output
    return result


def losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss_d"], r["loss_g"]) for r in read_jsonl(run_dir / "metrics.jsonl")
            if r["split"] == "train"}


def close(a: dict, b: dict, rel: float = 1e-5) -> bool:
    return a.keys() == b.keys() and all(x == pytest.approx(y, rel=rel) for k in a for x, y in zip(a[k], b[k]))


def state(run_dir: Path, part: str = "model") -> dict:
    return checkpoint_tensors(latest_checkpoint(run_dir), part)


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def level2_runs(tmp_path_factory) -> dict[str, Path]:
    """Level 2's uninterrupted runs: 1 x 4, 2 x 2 and 4 x 1 processes x accumulation, and 2 x 2 under fsdp."""
    root = tmp_path_factory.mktemp("level2")
    runs = {f"w{n}": root / f"w{n}" for n in (1, 2, 4)} | {"fsdp": root / "fsdp"}
    for n in (1, 2, 4):
        result = level2(runs[f"w{n}"], n)
        assert f"micro 8 x {n} ranks x {4 // n} accumulation" in result.stderr
    level2(runs["fsdp"], 2, "dist.strategy=fsdp")
    return runs


def test_level2_gives_the_same_losses_on_any_split_and_under_fsdp(level2_runs):
    w1, w2, w4 = (losses(level2_runs[k]) for k in ("w1", "w2", "w4"))
    assert sorted(w1) == list(range(1, 13))
    assert close(w2, w1) and close(w4, w1)
    assert close(losses(level2_runs["fsdp"]), w2)
    assert w1[12] != w1[1]  # they train: agreeing would prove nothing otherwise
    records = [r for r in read_jsonl(level2_runs["w2"] / "metrics.jsonl") if r["split"] == "train"]
    assert {"lr_g", "lr_d", "grad_norm_g", "grad_norm_d"} <= set(records[-1])
    assert records[-1]["lr_g"] < records[0]["lr_g"] and records[-1]["lr_d"] == records[0]["lr_d"]  # g's schedule
    val = [r for r in read_jsonl(level2_runs["w2"] / "metrics.jsonl") if r["split"] == "val"]
    assert [r["step"] for r in val] == [8, 12] and all(r["distance"] > 0 for r in val)  # eval_stats on the EMA


def test_level2_preemption_of_one_rank_resumes_exactly_and_on_another_world_size(tmp_path: Path, level2_runs):
    run_dir = tmp_path / "run"
    stopped = level2(run_dir, 2, fault=STOP, expect=75)
    assert "stopped by SIGTERM at step 5 with a checkpoint" in stopped.stderr
    assert checkpoints(run_dir) == ["step_00000005"]  # one checkpoint, mid-epoch
    elastic = tmp_path / "elastic"
    shutil.copytree(run_dir, elastic)
    level2(run_dir, 2)
    straight = level2_runs["w2"]
    assert losses(run_dir) == losses(straight)
    for part in ("model", "optim", "ema"):  # g and d, both optimizers' moments, g's average
        assert same_params(state(run_dir, part), state(straight, part)), part
    assert set(state(run_dir, "ema")) == {k for k in state(run_dir) if k.startswith("g.")}
    resumed = level2(elastic, 1)
    assert "saved by 2 process(es)" in resumed.stderr
    assert close(losses(elastic), losses(straight))


def test_level2_preemption_under_fsdp_resumes_exactly(tmp_path: Path, level2_runs):
    run_dir = tmp_path / "run"
    level2(run_dir, 2, "dist.strategy=fsdp", fault=STOP, expect=75)
    assert checkpoints(run_dir) == ["step_00000005"]
    level2(run_dir, 2, "dist.strategy=fsdp")
    assert losses(run_dir) == losses(level2_runs["fsdp"])
    assert same_params(state(run_dir), state(level2_runs["fsdp"]))


def test_level3_gives_level2s_losses_on_any_split(tmp_path: Path, level2_runs):
    """The loop of its own does level 2's arithmetic: 2 x 2 equals level 2's 2 x 2 run exactly (parameters and EMA
    too); 1 x 4 and 4 x 1 agree with it."""
    for n in (1, 2, 4):
        level3(tmp_path / f"w{n}", n)
    straight = level2_runs["w2"]
    assert losses(tmp_path / "w2") == losses(straight)
    assert same_params(state(tmp_path / "w2"), state(straight))
    assert same_params(state(tmp_path / "w2", "ema"), state(straight, "ema"))
    assert close(losses(tmp_path / "w1"), losses(straight)) and close(losses(tmp_path / "w4"), losses(straight))


def test_level3_preemption_of_one_rank_resumes_exactly_also_under_fsdp_and_on_another_world_size(
        tmp_path: Path, level2_runs):
    run_dir, elastic, sharded = tmp_path / "run", tmp_path / "elastic", tmp_path / "fsdp"
    stopped = level3(run_dir, 2, fault=STOP, expect=75)
    assert "stopped by SIGTERM at step 5 with a checkpoint" in stopped.stderr
    assert checkpoints(run_dir) == ["step_00000005"]
    shutil.copytree(run_dir, elastic)
    level3(run_dir, 2)
    assert losses(run_dir) == losses(level2_runs["w2"])
    assert same_params(state(run_dir), state(level2_runs["w2"]))
    level3(elastic, 4)
    assert close(losses(elastic), losses(level2_runs["w2"]))
    level3(sharded, 2, "dist.strategy=fsdp", fault=STOP, expect=75)
    level3(sharded, 2, "dist.strategy=fsdp")
    assert losses(sharded) == losses(level2_runs["fsdp"])
    assert same_params(state(sharded), state(level2_runs["fsdp"]))
