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
