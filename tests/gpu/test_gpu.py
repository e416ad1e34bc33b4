"""What only a GPU shows: NCCL device binding, bf16/fp16 autocast, compile, channels_last.
Skipped without CUDA; run through the device tool when a GPU is lent."""

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import read_jsonl, run_hpctrain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_digits_on_one_gpu_with_amp(tmp_path: Path, precision: str):
    result = run_hpctrain(
        ["train", "digits", f"run.dir={tmp_path}", f"train.precision={precision}", "train.epochs=8",
         "train.channels_last=true", "log.plots=false"], 300,
    )
    assert result.returncode == 0, result.output
    assert "single/cuda" in result.stderr  # one process on the GPU, no process group
    val = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "val"][-1]
    assert val["accuracy"] >= 0.9


def test_compiled_digits_on_gpu(tmp_path: Path):
    result = run_hpctrain(["train", "digits", f"run.dir={tmp_path}", "train.compile=true", "train.epochs=4"], 500)
    assert result.returncode == 0, result.output
    state = json.loads((tmp_path / "checkpoints" / "step_00000056" / "state.json").read_text())
    assert state["step"] == 56
