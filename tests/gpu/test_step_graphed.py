"""train.step_mode=graphed on a real GPU: the captured step trains as the eager one, in process and through the CLI
(a graphed run stopped and resumed continues the losses of an uninterrupted eager run, to bf16 tolerance).
Skipped without CUDA; run through the device tool when a GPU is lent (`make gpu-check-quick`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import read_jsonl, run_hpctrain, train_losses

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# The unit tests' tiny U-Net, on the GPU in bf16, without dropout: the graph's and eager dropout draw from one
# generator but are not promised to draw the same numbers, and this compares losses step by step.
GPU = ("train.precision=bf16", "model.dropout=0.0", "train.channels_last=true", "model.fixture_samples=512")


def test_the_captured_step_trains_as_the_eager_one_on_the_gpu(tmp_path: Path, monkeypatch):
    from tests.unit.test_step_modes import TINY, _train, _weights
    from hpctrain.dist.runtime import single_process_runtime
    from hpctrain.train import run
    from hpctrain.resolution import resolve_config
    from hpctrain.train.graphed import GraphedStep
    from hpctrain.train.step import EagerStep

    def context(name: str):
        cls, cfg = resolve_config("ddpm_cifar10", None, TINY + GPU + (f"run.dir={tmp_path / name}",))
        torch.manual_seed(0)
        return run.build_context(cfg, single_process_runtime(torch.device("cuda", 0)), cls(cfg), config_text="",
                                 write_run_dir=False, pretrained=False)

    eager, graphed = context("eager"), context("graphed")
    eager.stepper, graphed.stepper = EagerStep(), GraphedStep(warmup=3)
    e_loss, e_norm = _train(eager, 20)
    g_loss, g_norm = _train(graphed, 20)
    assert graphed.stepper.graph is not None and not graphed.stepper.failed
    assert g_loss == pytest.approx(e_loss, rel=2e-2) and g_norm == pytest.approx(e_norm, rel=5e-2)
    for a, b in zip(_weights(graphed), _weights(eager)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_a_graphed_run_resumed_continues_an_eager_runs_losses(tmp_path: Path):
    """auto's own case (one process, no accumulation) through the CLI, with validation and asynchronous checkpoints
    between replays, stopped at step 20 and resumed (a new capture at 20 + 11) in the other memory format."""
    from tests.unit.test_step_modes import TINY

    common = [*TINY, *GPU, "train.micro_batch_size=16", "train.max_steps=40", "log.every_steps=1", "log.plots=false",
              "ckpt.every_steps=10", "ckpt.async_save=true", "eval.every_steps=10", "log.outputs_every_steps=0",
              "log.outputs_every_epochs=0"]
    eager = run_hpctrain(["train", "ddpm_cifar10", *common, f"run.dir={tmp_path / 'eager'}",
                          "train.step_mode=eager"], 300)
    assert eager.returncode == 0, eager.output
    graphed = tmp_path / "graphed"
    # The first launch holds its weights (and AdamW's state) channels_last; the resumed one leaves the layout to
    # auto, NCHW for the U-Net's GroupNorm under a graph: a resume across layouts, and the config keeps 'auto'.
    first = run_hpctrain(["train", "ddpm_cifar10", *common, f"run.dir={graphed}", "train.stop_at_step=20"], 300)
    assert first.returncode == 0, first.output
    assert "step: graphed (auto: one process on CUDA)" in first.stderr and "CUDA graph at step 11" in first.stderr
    assert "layout: channels_last (train.channels_last=true)" in first.stderr
    second = run_hpctrain(["train", "ddpm_cifar10", *common, f"run.dir={graphed}", "train.channels_last=auto"], 300)
    assert second.returncode == 0, second.output
    assert "layout: NCHW (train.channels_last=auto: GroupNorm" in second.stderr
    assert 'channels_last = "auto"' in (graphed / "config.toml").read_text()
    assert "at step 20" in second.stderr and "step captured as a CUDA graph at step 31" in second.stderr
    want, got = train_losses(tmp_path / "eager"), train_losses(graphed)
    assert sorted(got) == sorted(want) == list(range(1, 41))
    assert [got[s] for s in range(1, 41)] == pytest.approx([want[s] for s in range(1, 41)], rel=3e-2)
    val = lambda d: [r["loss"] for r in read_jsonl(d / "metrics.jsonl") if r["split"] == "val"]  # noqa: E731
    assert len(val(graphed)) == len(val(tmp_path / "eager")) == 4
    assert val(graphed) == pytest.approx(val(tmp_path / "eager"), rel=3e-2)


def test_graphed_with_accumulation_through_the_cli(tmp_path: Path):
    """micro 8 x 2: the first GPU run read the second micro-batch's timesteps from memory the graph's pool reused
    (an index out of bounds at the first replay); the draw buffers are now made before the capture."""
    from tests.unit.test_step_modes import TINY

    res = run_hpctrain(["train", "ddpm_cifar10", *TINY, *GPU, "train.max_steps=20", "log.every_steps=1",
                        "log.plots=false", "eval.every_steps=10", f"run.dir={tmp_path}", "train.step_mode=graphed",
                        "log.outputs_every_steps=0", "log.outputs_every_epochs=0"], 300)
    assert res.returncode == 0, res.output
    assert "2 micro-batch(es), 4 draw(s)" in res.stderr
    losses = train_losses(tmp_path)
    assert len(losses) == 20 and all(0 < v < 10 for v in losses.values())
