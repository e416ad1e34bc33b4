"""Checkpoints of CUDA state: the staging copy goes through pinned buffers and is complete when the snapshot
returns, and a synchronous and an asynchronous save write the same bytes (CPU tensors, loadable without a GPU).
Skipped without CUDA; run through the device tool when a GPU is lent."""

from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.checkpoint import storage
from hpctrain.checkpoint.manager import Checkpointer
from hpctrain.checkpoint.snapshot import CpuStaging
from hpctrain.config.schema import OptimSection
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.train.ema import build_ema
from hpctrain.train.optim import build_optimizer, build_scheduler
from hpctrain.train.rng import capture_rng, restore_rng
from hpctrain.train.state import TrainState

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda", 0)


def cuda_state(steps: int = 3) -> dict:
    """Model (BatchNorm buffers), fused AdamW moments, scheduler, scaler and EMA on the GPU, after a few steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    model = model.to(CUDA)
    cfg = OptimSection(ema_decay=0.9)
    optimizer = build_optimizer(model, cfg, fused=True)
    stateful = {
        "model": model, "optimizer": optimizer, "scheduler": build_scheduler(optimizer, cfg, 100),
        "scaler": torch.amp.GradScaler("cuda", enabled=False), "ema": build_ema(model, cfg.ema_decay),
    }
    for _ in range(steps):
        train_step(stateful)
    return stateful


def train_step(stateful: dict) -> None:
    model, optimizer = stateful["model"], stateful["optimizer"]
    model(torch.randn(4, 3, 8, 8, device=CUDA)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    stateful["scheduler"].step()
    stateful["ema"].update_parameters(model)


def flat(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in flat(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in flat(v)]
    return []


def test_staging_copies_cuda_state_into_pinned_buffers_complete_on_return():
    stateful = cuda_state()
    live = {"model": stateful["model"].state_dict(), "optim": stateful["optimizer"].state_dict()}
    sources = flat(live)
    assert any(t.is_cuda for t in sources)
    expected = [t.detach().cpu().clone() for t in sources]
    staging = CpuStaging()
    # A long kernel queued before the snapshot: its non-blocking copies queue behind it, so only snapshot()'s own
    # synchronisation makes them complete before it returns (the check below reads the copy without any sync).
    torch.cuda._sleep(100_000_000)
    copy = staging.snapshot(live)
    copies = flat(copy)
    assert all(torch.equal(snap, value) for snap, value in zip(copies, expected)), "snapshot returned before its copies"
    # Training changes the live tensors at once: kernels queued right away must not reach the copy.
    for _ in range(3):
        train_step(stateful)
    assert len(copies) == len(sources)
    for source, snap, value in zip(sources, copies, expected):
        assert snap.device.type == "cpu" and snap.dtype == source.dtype and snap.shape == source.shape
        assert torch.equal(snap, value)
        if snap.numel():  # CPU sources (none with fused AdamW) stay pageable
            assert snap.is_pinned() == source.is_cuda
    # The next save reuses the pinned buffers, with the new values.
    buffers = {t.untyped_storage().data_ptr() for t in copies if t.numel()}
    second = flat(staging.snapshot(live))
    assert {t.untyped_storage().data_ptr() for t in second if t.numel()} == buffers
    for source, snap in zip(flat(live), second):
        assert torch.equal(snap, source.detach().cpu())


def test_the_checkpoint_stager_copies_cuda_state_into_reused_pinned_buffers_at_every_save():
    """The copy routine of every asynchronous save (hpctrain.compat.CheckpointStager; DCP's stager with pinned memory
    and non-blocking copies), on the tensor state the Checkpointer gives it, three saves in a row: on torch 2.11 the
    second failed (KeyError: <class 'type'>). Each copy is complete when stage() returns (a long kernel is queued
    first), private (training goes on at once), pinned, and in the same buffers as the save before."""
    from hpctrain.checkpoint import state_dicts as dcp_state
    from hpctrain.compat import CheckpointStager

    stateful = cuda_state()
    stager = CheckpointStager(cuda=True)
    buffers = []
    try:
        for _ in range(3):
            live = flat(dcp_state.tensor_state(stateful))
            expected = [t.detach().cpu().clone() for t in live]
            torch.cuda._sleep(100_000_000)
            copies = flat(stager.stage(dcp_state.tensor_state(stateful)))
            assert len(copies) == len(live) and any(t.is_cuda for t in live)
            assert all(torch.equal(c, e) for c, e in zip(copies, expected)), "stage() returned before its copies"
            train_step(stateful)
            torch.cuda.synchronize()
            assert all(torch.equal(c, e) for c, e in zip(copies, expected)), "training reached the copy"
            assert all(c.device.type == "cpu" for c in copies)
            assert all(c.is_pinned() for c, t in zip(copies, live) if t.is_cuda and t.numel() >= 1 << 16)
            buffers.append([c.untyped_storage().data_ptr() for c in copies if c.numel() > 1])
    finally:
        stager.close()
    assert buffers[0] == buffers[1] == buffers[2]


def test_sync_and_async_saves_of_cuda_state_hold_the_same_tensors_and_load_on_the_cpu(tmp_path: Path):
    """DCP's async_save stages the CUDA state into pinned host memory; both checkpoints hold the state at the call
    and load on a machine without a GPU (torch's own converter reads them into CPU tensors)."""
    from tests.conftest import checkpoint_tensors

    stateful = cuda_state()
    runtime = single_process_runtime(CUDA)
    state = TrainState(step=3, epoch=0, step_in_epoch=3, samples_seen=12).to_dict()
    torch.manual_seed(1)  # the RNG states (CPU and CUDA) both saves capture
    Checkpointer(tmp_path / "sync", "toy", runtime, "x = 1\n", 3, async_save=False).save(state, stateful,
                                                                                         capture_rng(CUDA))
    expected = {k: v.detach().cpu().clone() for k, v in stateful["model"].state_dict().items()}
    torch.manual_seed(1)
    background = Checkpointer(tmp_path / "async", "toy", runtime, "x = 1\n", 3, async_save=True)
    background.save(state, stateful, capture_rng(CUDA))
    for _ in range(2):
        train_step(stateful)
    background.settle()
    sync_dir = tmp_path / "sync" / "checkpoints" / "step_00000003"
    async_dir = tmp_path / "async" / "checkpoints" / "step_00000003"
    for name in ("train.pt", "rng.pt", "state.json", "config.toml"):  # rank 0's files, byte for byte
        assert storage.check_checkpoint(sync_dir).manifest["files"][name] == \
            storage.check_checkpoint(async_dir).manifest["files"][name], name
    for part in ("model", "optim", "ema"):
        a, b = checkpoint_tensors(sync_dir, part), checkpoint_tensors(async_dir, part)
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert a[key].device.type == "cpu" and torch.equal(a[key], b[key]), (part, key)
    model = checkpoint_tensors(async_dir, "model")
    assert all(torch.equal(model[k], expected[k]) for k in expected)  # the state at the call, not after

    # a second asynchronous save (into the stager's reused buffers) against a synchronous one of the same state
    state = TrainState(step=5, epoch=0, step_in_epoch=5, samples_seen=20).to_dict()
    torch.manual_seed(2)
    Checkpointer(tmp_path / "sync", "toy", runtime, "x = 1\n", 3, async_save=False).save(state, stateful,
                                                                                         capture_rng(CUDA))
    torch.manual_seed(2)
    background.save(state, stateful, capture_rng(CUDA))
    train_step(stateful)
    background.settle()
    for part in ("model", "optim", "ema"):
        a = checkpoint_tensors(tmp_path / "sync" / "checkpoints" / "step_00000005", part)
        b = checkpoint_tensors(tmp_path / "async" / "checkpoints" / "step_00000005", part)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor)), part


def test_a_resume_onto_the_gpu_restores_the_saved_state(tmp_path: Path):
    stateful = cuda_state()
    runtime = single_process_runtime(CUDA)
    Checkpointer(tmp_path, "toy", runtime, "", 3).save(TrainState(step=3).to_dict(), stateful, capture_rng(CUDA))
    after = torch.rand(3, device=CUDA)
    fresh = cuda_state(0)
    resumed = Checkpointer(tmp_path, "toy", runtime, "", 3).restore("auto", fresh)
    restore_rng(resumed.rng, CUDA)
    assert resumed.info["step"] == 3
    for name in ("model", "ema"):
        live, loaded = stateful[name].state_dict(), fresh[name].state_dict()
        assert all(loaded[k].device == live[k].device and torch.equal(loaded[k], live[k]) for k in live), name
    assert torch.equal(torch.rand(3, device=CUDA), after)  # the CUDA stream continues
