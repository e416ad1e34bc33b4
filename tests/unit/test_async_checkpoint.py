"""Asynchronous checkpoints (DCP's async_save inside hpctrain's integrity layer): the same state as a synchronous
save, taken at the moment of the call (training may change the live state at once), failures reported at the next
save, and a kill during the background write leaves the previous checkpoint valid."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.checkpoint import storage
from hpctrain.checkpoint.manager import Checkpointer
from hpctrain.config.schema import OptimSection
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.errors import UserError
from hpctrain.train.ema import build_ema
from hpctrain.train.optim import build_optimizer, build_scheduler
from hpctrain.train.rng import capture_rng
from hpctrain.train.state import TrainState
from tests.conftest import checkpoint_tensors

SINGLE = single_process_runtime(torch.device("cpu"))


def training_state(steps: int = 3) -> dict:
    """Model (with BatchNorm buffers), AdamW moments, scheduler, scaler and EMA after a few steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    cfg = OptimSection(ema_decay=0.9)
    optimizer = build_optimizer(model, cfg)
    stateful = {
        "model": model, "optimizer": optimizer, "scheduler": build_scheduler(optimizer, cfg, 100),
        "scaler": torch.amp.GradScaler("cpu", enabled=False), "ema": build_ema(model, cfg.ema_decay),
    }
    for _ in range(steps):
        train_step(stateful)
    return stateful


def train_step(stateful: dict) -> None:
    model, optimizer = stateful["model"], stateful["optimizer"]
    model(torch.randn(4, 3, 8, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    stateful["scheduler"].step()
    stateful["ema"].update_parameters(model)


def file_entries(path: Path) -> dict:
    return storage.check_checkpoint(path).manifest["files"]


def save(ckpt: Checkpointer, state: TrainState, stateful: dict, wait: bool = False) -> None:
    ckpt.save(state.to_dict(), stateful, capture_rng(SINGLE.device), wait=wait)


def test_async_save_holds_the_same_state_as_a_sync_save_taken_at_the_call(tmp_path: Path):
    stateful = training_state()
    state = TrainState(step=3, epoch=0, step_in_epoch=3, samples_seen=12)
    torch.manual_seed(1)  # the RNG state both saves capture
    save(Checkpointer(tmp_path / "sync", "toy", SINGLE, "x = 1\n", 3, async_save=False), state, stateful)
    torch.manual_seed(1)
    background = Checkpointer(tmp_path / "async", "toy", SINGLE, "x = 1\n", 3, async_save=True)
    save(background, state, stateful)
    before = {k: v.clone() for k, v in stateful["model"].state_dict().items()}
    for _ in range(2):  # training goes on while the write runs: it must not leak into the checkpoint
        train_step(stateful)
    assert any(not torch.equal(before[k], v) for k, v in stateful["model"].state_dict().items())
    background.settle()
    sync_dir = tmp_path / "sync" / "checkpoints" / "step_00000003"
    async_dir = tmp_path / "async" / "checkpoints" / "step_00000003"
    sync, written = file_entries(sync_dir), file_entries(async_dir)
    assert set(sync) == set(written) == {"dcp/.metadata", "dcp/__0_0.distcp", "train.pt", "rng.pt", "state.json",
                                         "config.toml"}
    for name in ("train.pt", "rng.pt", "state.json", "config.toml"):  # rank 0's files: byte for byte
        assert written[name] == sync[name], name
    for part in ("model", "optim", "ema"):  # DCP's files: every tensor, read back with torch's own converter
        a, b = checkpoint_tensors(sync_dir, part), checkpoint_tensors(async_dir, part)
        assert a.keys() == b.keys() and a
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key], b[key]), (part, key)
            else:
                assert a[key] == b[key], (part, key)
    assert checkpoint_tensors(sync_dir)["0.weight"].equal(before["0.weight"])  # the state at the call


def test_a_later_save_waits_for_the_earlier_write(tmp_path: Path, monkeypatch):
    spans: list[tuple[int, float, float]] = []
    real = storage.finish_checkpoint

    def slow_finish(root, tmp, step, entries, meta):
        start = time.perf_counter()
        time.sleep(0.3)
        path = real(root, tmp, step, entries, meta)
        spans.append((step, start, time.perf_counter()))
        return path

    monkeypatch.setattr(storage, "finish_checkpoint", slow_finish)
    stateful = training_state(1)
    ckpt = Checkpointer(tmp_path, "toy", SINGLE, "", 5, async_save=True)
    save(ckpt, TrainState(step=1), stateful)  # the first save sets up DCP's staging: not timed
    ckpt.settle()
    spans.clear()
    started = time.perf_counter()
    save(ckpt, TrainState(step=2), stateful)
    assert time.perf_counter() - started < 0.25, "the save call waited for the write"
    save(ckpt, TrainState(step=3), stateful)  # must wait for step 2's write before starting its own
    save(ckpt, TrainState(step=4), stateful, wait=True)
    assert [s for s, _, _ in spans] == [2, 3, 4]
    for (_, _, end), (_, start, _) in zip(spans, spans[1:]):
        assert start >= end
    assert [p.name for p in storage.list_checkpoints(tmp_path / "checkpoints")] == [
        "step_00000004", "step_00000003", "step_00000002", "step_00000001"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000004"


def test_a_failed_background_write_raises_at_the_next_save_and_names_its_step(tmp_path: Path, monkeypatch):
    ckpt = Checkpointer(tmp_path, "toy", SINGLE, "", 3, async_save=True)
    stateful = training_state(1)
    save(ckpt, TrainState(step=1), stateful)
    ckpt.settle()

    def full_disk(root, tmp, step, entries, meta):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "finish_checkpoint", full_disk)
    save(ckpt, TrainState(step=2), stateful)  # the failure happens in the background
    with pytest.raises(UserError, match="saving checkpoint at step 2 .* No space left on device") as err:
        save(ckpt, TrainState(step=3), stateful)
    assert "previous checkpoint is intact" in str(err.value)
    chosen, _ = storage.find_latest_valid(tmp_path / "checkpoints")
    assert chosen.path.name == "step_00000001"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the failed save's files are gone


CHILD = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path
    from hpctrain.checkpoint import storage
    from hpctrain.checkpoint.manager import Checkpointer
    from hpctrain.train.state import TrainState
    from tests.unit.test_async_checkpoint import SINGLE, save, training_state, train_step

    root = Path(sys.argv[1])
    stateful = training_state(1)
    ckpt = Checkpointer(root, "toy", SINGLE, "", 3, async_save=True)
    save(ckpt, TrainState(step=1), stateful, wait=True)
    real = storage.hash_file

    def stalling_hash(path):
        entry = real(path)
        if threading.current_thread().name != "MainThread":
            print("WRITING", flush=True)  # DCP's files are on disk in the temporary directory; no manifest comes
            time.sleep(600)
        return entry

    storage.hash_file = stalling_hash
    save(ckpt, TrainState(step=2), stateful)
    print("TRAINING", flush=True)
    while True:
        train_step(stateful)
""")


def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint_loadable(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[2], env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        seen = set()
        timer = threading.Timer(120, proc.kill)  # never hang the suite on a child that went wrong
        timer.start()
        for line in proc.stdout:
            seen.add(line.strip())
            if {"WRITING", "TRAINING"} <= seen:
                break
        timer.cancel()
        assert {"WRITING", "TRAINING"} <= seen, "the child never got into its background write"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    root = tmp_path / "checkpoints"
    assert list(root.glob(".tmp-step_00000002-*")), "the interrupted write was not in progress"
    chosen, skipped = storage.find_latest_valid(root)
    assert chosen.path.name == "step_00000001" and not skipped
    restored = training_state(0)
    resumed = Checkpointer(tmp_path, "toy", SINGLE, "", 3, async_save=True).restore("auto", restored)
    assert resumed.info["step"] == 1


def test_snapshot_keeps_views_and_shared_objects_and_owns_its_memory():
    import io
    from hpctrain.checkpoint.snapshot import cpu_snapshot

    x = torch.arange(10.0)
    betas = (0.9, 0.999)
    tree = {"a": x, "view": x[2:5], "again": [x], "empty": torch.empty(0), "g": [{"betas": betas}, {"betas": betas}]}
    copy = cpu_snapshot(tree)
    assert copy["again"][0] is copy["a"] and copy["g"][0]["betas"] is copy["g"][1]["betas"]
    assert copy["view"].untyped_storage().data_ptr() == copy["a"].untyped_storage().data_ptr() != x.data_ptr()
    x.add_(1)
    assert torch.equal(copy["view"], torch.tensor([2.0, 3.0, 4.0]))
    live, snap = io.BytesIO(), io.BytesIO()
    x.sub_(1)
    torch.save(tree, live)
    torch.save(copy, snap)
    assert live.getvalue() == snap.getvalue()


def test_staging_reuses_last_snapshots_buffers_with_the_new_values():
    from hpctrain.checkpoint.snapshot import CpuStaging

    staging, live = CpuStaging(), {"w": torch.arange(6.0), "b": torch.ones(3)}
    first = staging.snapshot(live)
    buffer = first["w"].untyped_storage().data_ptr()
    live["w"].mul_(2)
    second = staging.snapshot(live)
    assert second["w"].untyped_storage().data_ptr() == buffer  # no fresh allocation
    assert torch.equal(second["w"], torch.arange(6.0) * 2) and torch.equal(second["b"], torch.ones(3))
    live["w"] = torch.zeros(10)  # a different size: fresh memory, not a wrong-sized buffer
    assert torch.equal(staging.snapshot(live)["w"], torch.zeros(10))
