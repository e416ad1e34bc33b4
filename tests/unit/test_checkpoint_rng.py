"""Random streams in checkpoints: Python's, NumPy's global one and torch's continue after a resume exactly as
in an uninterrupted run; a checkpoint written before NumPy's stream was captured still loads."""

import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

from hpctrain.checkpoint import storage
from hpctrain.checkpoint.manager import Checkpointer
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.train.rng import capture_rng, restore_rng
from hpctrain.train.state import TrainState

CPU = torch.device("cpu")
SINGLE = single_process_runtime(CPU)


def draws() -> dict:
    return {"numpy": np.random.rand(5).tolist() + [np.random.normal(), np.random.randint(0, 2**31)],
            "torch": torch.rand(5).tolist(), "python": [random.random() for _ in range(5)]}


def scramble() -> None:
    random.seed(99)
    np.random.seed(99)
    np.random.normal()  # leaves a cached Gaussian in the legacy state: it must not survive a restore
    torch.manual_seed(99)


def test_capture_then_restore_continues_every_stream():
    np.random.seed(3)
    torch.manual_seed(3)
    random.seed(3)
    np.random.normal()
    saved = capture_rng(CPU)
    uninterrupted = draws()
    scramble()
    restore_rng(saved, CPU)
    assert draws() == uninterrupted


def stateful() -> dict:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"model": model, "optimizer": optimizer,
            "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
            "scaler": torch.amp.GradScaler("cpu", enabled=False), "ema": None}


def save(tmp_path: Path, step: int) -> None:
    Checkpointer(tmp_path, "toy", SINGLE, "", 3).save(TrainState(step=step).to_dict(), stateful(), capture_rng(CPU))


def resume(tmp_path: Path):
    """What a resumed launch does with the checkpoint's streams (train/run.py)."""
    resumed = Checkpointer(tmp_path, "toy", SINGLE, "", 3).restore("auto", stateful())
    assert resumed.rng is not None  # same world size: the saved streams come back
    restore_rng(resumed.rng, CPU)
    return resumed


def test_numpy_draws_after_a_resume_equal_the_uninterrupted_run(tmp_path: Path):
    np.random.seed(5)
    np.random.rand(7)
    save(tmp_path, 4)
    uninterrupted = draws()
    scramble()
    assert resume(tmp_path).info["step"] == 4
    assert draws() == uninterrupted  # through torch.save and a weights_only load


def test_a_checkpoint_without_the_numpy_stream_still_loads(tmp_path: Path):
    """Written as hpctrain did before: the other streams are restored, NumPy's is left as it was."""
    import json

    save(tmp_path, 2)
    path = tmp_path / "checkpoints" / "step_00000002"
    entries = storage.load_file(path, "rng.pt")
    assert "numpy" in entries[0]
    old = [{k: v for k, v in e.items() if k != "numpy"} for e in entries]
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] |= storage.write_files(path, {"rng.pt": old})  # a valid checkpoint with the old rng.pt
    (path / "manifest.json").write_text(json.dumps(manifest))
    torch.set_rng_state(old[0]["torch"])
    expected_torch = torch.rand(3)
    np.random.seed(11)
    expected_numpy = np.random.rand(3)
    np.random.seed(11)
    torch.manual_seed(99)
    assert resume(tmp_path).info["step"] == 2
    assert torch.equal(torch.rand(3), expected_torch)  # the streams it has are restored
    np.testing.assert_array_equal(np.random.rand(3), expected_numpy)  # the one it lacks is left alone
