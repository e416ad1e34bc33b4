"""A resume with another train.global_batch_size: the checkpoint records the batch its data position counts in,
a change stops before launch (exit 2, nothing written) unless ckpt.on_batch_change=restart_epoch, and
checkpoints from before the field existed still load (train and eval)."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.checkpoint import storage
from hpctrain.checkpoint.manager import Checkpointer
from hpctrain.cli import main
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.errors import UserError
from hpctrain.train.state import TrainState, continue_with_batch
from tests.conftest import write_dcp_checkpoint

SINGLE = single_process_runtime(torch.device("cpu"))
SAVED = TrainState(step=20, epoch=1, step_in_epoch=6, samples_seen=800, global_batch_size=40)


def test_the_checkpoint_records_the_global_batch(tmp_path: Path):
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stateful = {"model": model, "optimizer": optimizer, "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                "scaler": torch.amp.GradScaler("cpu", enabled=False), "ema": None}
    Checkpointer(tmp_path, "toy", SINGLE, "", 3).save(SAVED.to_dict(), stateful, {"python": None})
    saved = json.loads((tmp_path / "checkpoints" / "step_00000020" / "state.json").read_text())
    assert saved["global_batch_size"] == 40 and saved["step_in_epoch"] == 6
    assert TrainState.from_dict(saved) == SAVED


def test_same_batch_continues_silently():
    assert continue_with_batch(SAVED, 40, "error", "ck", 100) == (SAVED, "")


def test_changed_batch_is_an_error_that_says_what_changed_and_what_to_do():
    with pytest.raises(UserError) as err:
        continue_with_batch(SAVED, 20, "error", "run/checkpoints/step_00000020", 100)
    text = str(err.value)
    assert "checkpoint 'run/checkpoints/step_00000020' was saved with 40, this launch has 20" in text
    assert "6 steps into epoch 1" in text and "nothing was changed" in text
    assert "train.global_batch_size=40" in err.value.hint and "ckpt.on_batch_change=restart_epoch" in err.value.hint


def test_restart_epoch_keeps_step_and_epoch_and_starts_the_epoch_again():
    state, warning = continue_with_batch(SAVED, 20, "restart_epoch", "ck", 300)
    assert state == TrainState(step=20, epoch=1, step_in_epoch=0, samples_seen=800, global_batch_size=20)
    assert "changed from 40 to 20" in warning and "epoch 1 starts again" in warning
    assert "first 240 samples" in warning and "continues at step 20 of 300" in warning


def test_a_checkpoint_without_the_field_loads_with_a_warning():
    old = TrainState.from_dict({"step": 20, "epoch": 1, "step_in_epoch": 6, "samples_seen": 800, "world_size": 2})
    assert old.global_batch_size == 0
    state, warning = continue_with_batch(old, 20, "error", "ck", 100)
    assert (state.step, state.step_in_epoch, state.global_batch_size) == (20, 6, 20)
    assert "does not record train.global_batch_size" in warning and "ck/config.toml" in warning


def write_digits_checkpoint(run_dir: Path, state: dict) -> Path:
    """A checkpoint the preflight reads (state.json and manifest); its tensors are never loaded here."""
    files = {"model.pt": {"w": torch.zeros(1)}, "state.json": json.dumps(state | {"world_size": 2})}
    return storage.write_checkpoint(run_dir / "checkpoints", state["step"], files, {"experiment": "digits"})


def test_changed_batch_stops_before_launch_and_writes_nothing(capsys, tmp_path: Path):
    write_digits_checkpoint(tmp_path, SAVED.to_dict())
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    code = main(["train", "digits", f"run.dir={tmp_path}", "--nproc-per-node", "2", "train.global_batch_size=20",
                 "train.micro_batch_size=10"])
    err = capsys.readouterr().err
    assert code == 2 and "was saved with 40, this launch has 20" in err and "Traceback" not in err
    assert "starting 2 processes" not in err
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


def test_eval_loads_a_checkpoint_without_the_field(tmp_path: Path):
    model = nn.Linear(3, 2)
    old_state = {"step": 5, "epoch": 0, "step_in_epoch": 5, "samples_seen": 200, "world_size": 1}
    saved = nn.Linear(3, 2).state_dict()
    write_dcp_checkpoint(tmp_path / "checkpoints", 5, {"model": saved}, {"state.json": json.dumps(old_state)},
                         {"experiment": "toy"})
    loaded = Checkpointer(tmp_path, "toy", SINGLE, "", 3).restore_weights("auto", model)
    state = TrainState.from_dict(loaded.info)
    assert state.step == 5 and state.global_batch_size == 0
    assert torch.equal(model.weight, saved["weight"])
