import json
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint import storage
from hpctrain.checkpoint.policy import select_checkpoint
from hpctrain.checkpoint.policy import save_due, steps_to_delete
from hpctrain.errors import UserError


def save(root: Path, step: int, experiment: str = "digits") -> Path:
    files = {"model.pt": {"w": torch.full((64,), float(step))}, "state.json": json.dumps({"step": step})}
    return storage.write_checkpoint(root, step, files, {"experiment": experiment})


def test_write_then_verify_and_load(tmp_path: Path):
    path = save(tmp_path, 12)
    assert path.name == "step_00000012"
    assert (tmp_path / "latest").read_text().strip() == "step_00000012"
    checked = storage.check_checkpoint(path)
    assert checked.valid and checked.manifest["experiment"] == "digits"
    assert set(checked.manifest["files"]) == {"model.pt", "state.json"}
    assert torch.equal(storage.load_file(path, "model.pt")["w"], torch.full((64,), 12.0))
    assert not list(tmp_path.glob(".tmp-*")), "no temporary directory left behind"


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda p: truncate(p / "model.pt"), "truncated"),
        (lambda p: flip_byte(p / "model.pt"), "checksum mismatch"),
        (lambda p: (p / "model.pt").unlink(), "missing"),
        (lambda p: (p / "manifest.json").unlink(), "no manifest"),
        (lambda p: (p / "manifest.json").write_text("{"), "unreadable manifest"),
    ],
)
def test_damaged_latest_falls_back_to_the_previous_one(tmp_path: Path, damage, problem):
    save(tmp_path, 10)
    newest = save(tmp_path, 20)
    damage(newest)
    chosen, skipped = storage.find_latest_valid(tmp_path)
    assert chosen.path.name == "step_00000010"
    assert [c.path.name for c in skipped] == ["step_00000020"]
    assert problem in skipped[0].problem


def test_only_a_corrupt_checkpoint_is_an_error_and_deletes_nothing(tmp_path: Path):
    path = save(tmp_path, 5)
    flip_byte(path / "model.pt")
    with pytest.raises(UserError, match="none is valid") as err:
        select_checkpoint(tmp_path, "auto", "digits")
    assert "checksum mismatch" in str(err.value)
    assert (path / "model.pt").exists() and (path / "manifest.json").exists()


def test_resume_policies(tmp_path: Path):
    assert select_checkpoint(tmp_path / "none", "auto", "digits") == (None, [])
    save(tmp_path, 3)
    assert select_checkpoint(tmp_path, "auto", "digits")[0].path.name == "step_00000003"
    with pytest.raises(UserError, match="already holds checkpoints"):
        select_checkpoint(tmp_path, "never", "digits")
    with pytest.raises(UserError, match="written by experiment 'digits', not 'toy'"):
        select_checkpoint(tmp_path, "auto", "toy")
    explicit = select_checkpoint(tmp_path, str(tmp_path / "step_00000003"), "digits")[0]
    assert explicit.valid
    with pytest.raises(UserError, match="not usable: no manifest"):
        select_checkpoint(tmp_path, str(tmp_path / "nope"), "digits")


def test_saving_the_same_step_again_replaces_it_atomically(tmp_path: Path):
    save(tmp_path, 7)
    storage.write_checkpoint(tmp_path, 7, {"model.pt": {"w": torch.zeros(1)}}, {"experiment": "digits"})
    path = tmp_path / "step_00000007"
    checked = storage.check_checkpoint(path)
    # Replaced, not merged or kept: the second save's content, and none of the first's files.
    assert checked.valid and set(checked.manifest["files"]) == {"model.pt"} and not (path / "state.json").exists()
    assert torch.equal(storage.load_file(path, "model.pt")["w"], torch.zeros(1))
    assert (tmp_path / "latest").read_text().strip() == "step_00000007"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path: Path):
    save(tmp_path, 1)

    class Unpicklable:
        def __reduce__(self):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        storage.write_checkpoint(tmp_path, 2, {"model.pt": Unpicklable()}, {"experiment": "digits"})
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert not list(tmp_path.glob(".tmp-*")) and not (tmp_path / "step_00000002").exists()


def test_save_policy():
    assert [s for s in range(1, 26) if save_due(s, 25, 10)] == [10, 20, 25]
    assert [s for s in range(1, 26) if save_due(s, 25, 0)] == [25]


def test_retention_never_deletes_the_latest():
    assert steps_to_delete([10, 20, 30, 40], keep_last=2, protected=40) == [10, 20]
    assert steps_to_delete([10, 20, 30, 40], keep_last=1, protected=20) == [10, 30]
    assert steps_to_delete([10], keep_last=1, protected=10) == []
