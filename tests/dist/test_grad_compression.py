"""dist.grad_compression: DDP's bf16 comm hook is registered and trains like the uncompressed run
(sums rounded to bf16: close, not equal)."""

from pathlib import Path

import pytest

from tests.conftest import run_hpctrain, train_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(200)]

ARGS = ["train", "digits", "--nproc-per-node", "2", "model.width=8", "train.global_batch_size=40",
        "train.micro_batch_size=10", "train.max_steps=12", "log.every_steps=1", "log.plots=false",
        "log.tensorboard=false", "optim.lr=1e-3", "optim.warmup_steps=0"]


def test_bf16_gradient_compression_trains_close_to_full_precision(tmp_path: Path):
    runs = {}
    for mode in ("none", "bf16"):
        result = run_hpctrain([*ARGS, f"run.dir={tmp_path / mode}", f"dist.grad_compression={mode}"], timeout=150)
        assert result.returncode == 0, result.output
        runs[mode] = train_losses(tmp_path / mode)
    assert sorted(runs["none"]) == sorted(runs["bf16"]) == list(range(1, 13))
    assert runs["none"][1] == runs["bf16"][1]  # step 1's loss is computed before any all-reduce
    assert runs["bf16"] != runs["none"], "the hook changed nothing: was it registered?"
    for step, full in runs["none"].items():
        assert runs["bf16"][step] == pytest.approx(full, rel=2e-2)
