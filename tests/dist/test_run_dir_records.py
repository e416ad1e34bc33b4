"""What a run dir holds belongs to one run: a resume refused because the model changed leaves the run dir as it was
(its config.toml above all, which export, eval and report read) and names the setting that differs from the
checkpoint's; a fresh start does not append to an earlier attempt's records."""

import hashlib
import json
from pathlib import Path

import pytest

from tests.conftest import read_jsonl, run_hpctrain

pytestmark = [pytest.mark.dist, pytest.mark.timeout(200)]


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "heartbeat" not in p.parts}


def test_a_refused_resume_changes_nothing_and_names_the_changed_key(tmp_path: Path):
    common = [f"run.dir={tmp_path}", "train.max_steps=6", "log.plots=false", "log.tensorboard=false"]
    first = run_hpctrain(["train", "digits", *common], 120)
    assert first.returncode == 0, first.output
    before = digest(tmp_path)
    refused = run_hpctrain(["train", "digits", *common, "model.width=8"], 120)
    assert refused.returncode == 2, refused.output
    assert "model.width is 8 here but 32 in the checkpoint" in refused.stderr, refused.output
    assert digest(tmp_path) == before  # no config.<time>.toml, no new config.toml, no appended metrics
    exported = run_hpctrain(["export", str(tmp_path)], 120)  # reads the run dir's config: still the good one
    assert exported.returncode == 0, exported.output


def test_a_fresh_start_sets_an_earlier_attempts_records_aside(tmp_path: Path):
    """An attempt stopped before its first save (or another experiment) left metrics.jsonl and no checkpoint: the new
    run's report must not count its lines."""
    old = [{"step": s, "split": "train", "loss": 9.0, "time": 0.0} for s in range(1, 281)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    result = run_hpctrain(["train", "digits", f"run.dir={tmp_path}", "train.max_steps=6", "log.every_steps=1",
                           "log.plots=false", "log.tensorboard=false"], 120)
    assert result.returncode == 0, result.output
    assert "held an earlier attempt's records" in result.stderr, result.output
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "train"]
    assert steps == list(range(1, 7))
    kept = list(tmp_path.glob("metrics.*.jsonl"))
    assert len(kept) == 1 and len(read_jsonl(kept[0])) == 280
    report = run_hpctrain(["report", str(tmp_path)], 120)
    assert report.returncode == 0 and "optimizer steps logged: 6" in report.stdout, report.output


def test_eval_reads_the_runs_own_config(tmp_path: Path):
    """A run trained with other model keys than the experiment's defaults: `hpctrain eval EXP run.dir=RUN` loads it
    (it used to build the default model and fail with a size mismatch unless given --config RUN/config.toml)."""
    trained = run_hpctrain(["train", "digits", f"run.dir={tmp_path}", "model.width=8", "train.max_steps=4",
                            "log.plots=false", "log.tensorboard=false"], 120)
    assert trained.returncode == 0, trained.output
    evaluated = run_hpctrain(["eval", "digits", f"run.dir={tmp_path}"], 120)
    assert evaluated.returncode == 0, evaluated.output
    metrics = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert 0 <= metrics["accuracy"] <= 1


RECORDS_RUN = ["--nproc-per-node=2", "model.width=8", "model.norm=group", "train.global_batch_size=32",
               "train.micro_batch_size=16", "train.max_steps=30", "log.every_steps=10", "eval.every_steps=10",
               "ckpt.every_steps=0", "log.plots=false", "log.tensorboard=false"]
SAME = ("step", "epoch", "lr", "grad_norm", "accuracy")
"""Compared exactly. loss to 1e-6 relative: each rank sums a window's losses in float32, and a window continued
across a resume is summed in two parts (measured: 2e-8). Time-based fields (time, samples_per_s, eta_s,
data_wait_frac, gpu_busy) differ by nature."""


def test_records_after_a_preemption_equal_an_uninterrupted_runs(tmp_path: Path):
    """A SIGTERM between two log steps: no partial record at the stop, the checkpoint holds the open window and the
    resumed run's next record averages the same 10 steps; a stop and a resume record mark where, for the report."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert run_hpctrain(["train", "digits", f"run.dir={whole}", *RECORDS_RUN], 200).returncode == 0
    stopped = run_hpctrain(["train", "digits", f"run.dir={split}", *RECORDS_RUN], 200,
                           env={"HPCTRAIN_FAULT": "signal:rank=1:step=13"})  # lands at step 14 or 15
    assert stopped.returncode == 75, stopped.output
    resumed = run_hpctrain(["train", "digits", f"run.dir={split}", *RECORDS_RUN], 200)
    assert resumed.returncode == 0, resumed.output

    raw = read_jsonl(split / "metrics.jsonl")
    (stop,) = [r for r in raw if r["split"] == "stop"]
    (resume,) = [r for r in raw if r["split"] == "resume"]
    assert stop["step"] == resume["step"] in (14, 15) and stop["signal"] == "SIGTERM"
    assert resume["world_size"] == resume["saved_world_size"] == 2
    measured = [r for r in raw if r["split"] in ("train", "val")]  # every line, none replaced by a later one
    expected = [r for r in read_jsonl(whole / "metrics.jsonl") if r["split"] in ("train", "val")]
    assert [(r["split"], r["step"]) for r in measured] == [(r["split"], r["step"]) for r in expected]
    assert [r["step"] for r in measured if r["split"] == "train"] == [10, 20, 30]
    for got, want in zip(measured, expected):
        assert {k: got.get(k) for k in SAME} == {k: want.get(k) for k in SAME}, (got, want)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), (got, want)

    report = run_hpctrain(["report", str(split)], 120)
    assert report.returncode == 0, report.output
    assert f"stopped by SIGTERM at step {stop['step']}; resumed at step {stop['step']}" in report.stdout
