"""`hpctrain check resume`'s comparison (train/resume_record.py) and its command's bad input, without processes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.commands.check import Plan, plan_of, render_verdict
from hpctrain.errors import UserError
from hpctrain.train.resume_record import ResumeRecorder, first_difference, object_hashes, read_records


def _record(step: int, batches: str = "b", lr: float = 0.1, model: str = "m", buffers: str = "x") -> dict:
    return {"step": step, "batches": f"{batches}{step}", "lr": {"opt": [lr]},
            "objects": {"model.g": f"{model}{buffers}{step}", "optimizers.opt": f"o{step}"},
            "parameters": {"model.g": f"{model}{step}"}}


def _runs(**changes) -> tuple[dict, dict]:
    straight = {r: {s: _record(s) for s in (1, 2, 3)} for r in (0, 1)}
    resumed = {r: {s: _record(s, **(changes if s == 3 else {})) for s in (1, 2, 3)} for r in (0, 1)}
    return straight, resumed


def test_identical_runs_have_no_difference():
    assert first_difference(*_runs(), [], []) == ""


@pytest.mark.parametrize("change, words", [
    ({"batches": "other"}, "step 3, rank 0: the micro-batches differ"),
    ({"lr": 0.2}, "step 3, rank 0: the learning rate of optimizer 'opt' differs ([0.1] uninterrupted, [0.2] resumed)"),
    ({"model": "z"}, "step 3, rank 0: the state of 'model.g' differs"),
])
def test_the_first_difference_names_its_step_rank_and_what(change, words):
    assert words in first_difference(*_runs(**change), [], [])


def test_another_ranks_buffers_are_not_compared_its_parameters_are():
    """A checkpoint holds rank 0's buffers for every rank: rank 1's own running statistics may differ after a
    resume, its parameters may not."""
    straight, resumed = _runs()
    resumed[1][3] = _record(3, buffers="y")
    assert first_difference(straight, resumed, [], []) == ""
    resumed[0][3] = _record(3, buffers="y")
    assert "rank 0: the state of 'model.g'" in first_difference(straight, resumed, [], [])
    resumed[0][3], resumed[1][3] = _record(3), _record(3, model="z")
    assert "rank 1: the state of 'model.g'" in first_difference(straight, resumed, [], [])


def test_logged_values_are_compared_exactly_on_one_world_size_and_to_1e5_on_another():
    straight, resumed = _runs()
    logged = [{"step": 2, "split": "train", "loss": 1.0, "time": 5.0, "samples_per_s": 3.0}]
    again = [{"step": 2, "split": "train", "loss": 1.0 + 1e-7, "time": 9.0, "samples_per_s": 4.0}]
    assert "step 2: the logged loss differs" in first_difference(straight, resumed, logged, again)
    one_rank = {0: resumed[0]}  # resumed on another number of processes: rank 0 only, values to 1e-5
    assert first_difference(straight, one_rank, logged, again) == ""
    assert "loss" in first_difference(straight, one_rank, logged, [{**again[0], "loss": 1.01}])


def test_the_recorder_writes_a_line_per_step_with_the_batches_and_objects(tmp_path: Path):
    recorder = ResumeRecorder(tmp_path / "rank_0.jsonl")
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    recorder.saw((torch.ones(2, 2), torch.zeros(2)))
    recorder.record(1, {"model": model, "optimizer": opt, "scheduler": None})
    recorder.saw((torch.ones(2, 2), torch.ones(2)))
    recorder.record(2, {"model": model, "optimizer": opt, "scheduler": None})
    recorder.close()
    lines = read_records(tmp_path)[0]
    assert sorted(lines) == [1, 2] and lines[1]["batches"] != lines[2]["batches"]
    assert lines[1]["lr"] == {"optimizer": [0.5]} and set(lines[1]["objects"]) == {"model", "optimizer"}
    before = object_hashes({"model": model})
    with torch.no_grad():
        model.weight.add_(1e-6)
    assert object_hashes({"model": model}) != before
    assert not ResumeRecorder(None)  # a run no check started records nothing


def _args(**kw) -> argparse.Namespace:
    base = dict(target="toy:Exp", overrides=[], config_file=None, script_args=[], steps=8, stop_after=0,
                nproc_per_node=1, resume_nproc=0)
    return argparse.Namespace(**(base | kw))


@pytest.mark.parametrize("kw, words", [
    ({"target": "missing.py"}, "script 'missing.py' does not exist"),
    ({"script_args": ["--lr", "1"]}, "arguments after -- are a script's"),
    ({"steps": 2}, "--steps 2: too few"),
    ({"stop_after": 7}, "--stop-after 7 leaves no step to resume"),
    ({"nproc_per_node": 0}, "--nproc-per-node 0"),
])
def test_bad_input_to_check_resume_is_a_message(kw, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(")):
        plan_of(_args(**kw))


def test_the_plan_and_verdict():
    plan = plan_of(_args(steps=10))
    assert (plan.stop_after, plan.resume_nproc) == (4, 1)
    assert "stopped at step 6 of 10; resumed exactly" in render_verdict(plan, 6, "")
    other = Plan(**{**plan.__dict__, "resume_nproc": 2})
    assert "to 1e-5" in render_verdict(other, 6, "") and "step 7" in render_verdict(other, 6, "step 7: x")
