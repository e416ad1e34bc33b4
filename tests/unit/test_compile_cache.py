"""The run's compile cache (train/compile_cache.py): packed by rank 0 into one file per torch/Triton/device, unpacked
into each rank's own folder on another node, left alone when the user manages TORCHINDUCTOR_CACHE_DIR. The
cold/warm compile times are benchmarks/compile_cache.py's (BENCHMARKS.md)."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import pytest
import torch

from hpctrain.train import compile_cache as cc

CPU = torch.device("cpu")


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A fresh node: its own temporary folder, and TORCHINDUCTOR_CACHE_DIR as Inductor leaves it."""
    def make(name: str) -> Path:
        tmp = tmp_path / name
        tmp.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        monkeypatch.delenv(cc.ENV, raising=False)
        return tmp
    return make


def _fill(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


def test_the_key_names_torch_triton_and_the_device():
    key = cc.cache_key(CPU)
    assert key.startswith(f"torch-{torch.__version__}") and "_triton-" in key and "_cpu-" in key
    assert "/" not in key and " " not in key


def test_packed_on_one_node_and_unpacked_on_another(tmp_path, node, caplog):
    caplog.set_level(logging.INFO, "hpctrain")
    run = tmp_path / "run"
    node("first")
    first = cc.CompileCache(run, CPU, is_main=True, local_rank=0)
    assert first.load() is False and os.environ[cc.ENV] == str(first.local)  # nothing yet: compile, into our folder
    _fill(first.local, {"fxgraph/ab/entry": b"graph", "triton/0/kernel.cubin": b"k" * 100, "x.lock": b""})
    # local rank 3 on the same node: its own folder (Inductor's entries name the device index), packed by rank 0 too
    _fill(first.node / "rank3", {"fxgraph/cd/entry": b"graph on cuda:3"})
    first.save()
    assert first.path.is_file() and first.path.parent == run / "compile-cache"
    stamp = first.path.stat().st_mtime_ns
    first.save()  # nothing new: not rewritten
    assert first.path.stat().st_mtime_ns == stamp
    node("second")
    second = cc.CompileCache(run, CPU, is_main=False, local_rank=3)
    assert second.local != first.local and second.local.name == "rank3"
    assert second.load() is True and os.environ[cc.ENV] == str(second.local)
    assert (second.local / "fxgraph/cd/entry").read_bytes() == b"graph on cuda:3"  # its own part only
    assert not (second.node / "rank0").exists()
    third = cc.CompileCache(run, CPU, is_main=False, local_rank=0)
    assert third.load() is True and (third.local / "fxgraph/ab/entry").read_bytes() == b"graph"
    assert (third.local / "triton/0/kernel.cubin").stat().st_size == 100 and not (third.local / "x.lock").exists()
    other_run = cc.CompileCache(tmp_path / "another-run", CPU, is_main=False, local_rank=0)
    assert other_run.local != third.local  # two runs (jobs) on one node never share a folder
    second.save()  # not rank 0: never writes
    assert first.path.stat().st_mtime_ns == stamp


def test_a_file_for_another_torch_or_gpu_is_left_alone_and_a_damaged_one_is_not_fatal(tmp_path, node, caplog):
    caplog.set_level(logging.INFO, "hpctrain")
    run = tmp_path / "run"
    node("n")
    cache = cc.CompileCache(run, CPU, is_main=True)
    cache.folder.mkdir(parents=True)
    (cache.folder / "torch-2.9.0_triton-3.4.0_NVIDIA-A100.tar").write_bytes(b"")
    assert cache.load() is False and "not used: torch-2.9.0_triton-3.4.0_NVIDIA-A100.tar" in caplog.text
    cache.path.write_bytes(b"not a tar file at all")
    assert cache.load() is False and "could not be unpacked" in caplog.text


def test_a_cache_folder_the_user_chose_is_used_as_it_is(tmp_path, node, monkeypatch):
    node("n")
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv(cc.ENV, default_cache_dir())  # what Inductor writes there itself: not the user's choice
    assert cc.CompileCache(tmp_path, CPU, True).managed
    mine = str(tmp_path / "mine")
    monkeypatch.setenv(cc.ENV, mine)
    cache = cc.CompileCache(tmp_path / "run", CPU, True)
    assert not cache.managed and cache.load() is False and os.environ[cc.ENV] == mine
    cache.save()
    assert not cache.folder.exists()
