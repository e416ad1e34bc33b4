"""The run's compile cache (train/compile_cache.py): packed by rank 0 into one file per torch/Triton/device, unpacked
into each rank's own folder on another node, left alone when the user manages TORCHINDUCTOR_CACHE_DIR. The
cold/warm compile times are benchmarks/compile_cache.py's (BENCHMARKS.md)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
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


def test_a_failed_save_warns_once_and_the_run_goes_on(tmp_path, node, caplog, monkeypatch):
    """The cache only saves compile time, and save() runs right after a good checkpoint: an I/O error must not end
    the run (it used to raise on rank 0)."""
    caplog.set_level(logging.INFO, "hpctrain")
    run = tmp_path / "run"
    node("n")
    cache = cc.CompileCache(run, CPU, is_main=True)
    cache.load()
    _fill(cache.local, {"fxgraph/ab/entry": b"graph"})
    cache.save()
    good = cache.path.read_bytes()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cc.tarfile.TarFile, "add", full_disk)
    _fill(cache.local, {"fxgraph/cd/entry": b"more"})
    cache.save()
    assert "could not pack" in caplog.text and "No space left on device" in caplog.text
    assert cache.path.read_bytes() == good and not list(cache.folder.glob(".*tmp*"))  # the old file, whole
    caplog.clear()
    _fill(cache.local, {"fxgraph/ef/entry": b"still more"})
    cache.save()  # not tried again: one warning per run
    assert "could not pack" not in caplog.text


def test_an_unwritable_cache_folder_is_not_fatal(tmp_path, node, caplog):
    caplog.set_level(logging.WARNING, "hpctrain")
    run = tmp_path / "run"
    run.mkdir()
    (run / cc.FOLDER).write_text("a file where the folder should be")
    node("n")
    cache = cc.CompileCache(run, CPU, is_main=True)
    cache.load()
    _fill(cache.local, {"fxgraph/ab/entry": b"graph"})
    cache.save()
    assert "could not pack" in caplog.text


def test_the_node_copy_is_removed_when_the_run_ends_and_loads_again_from_the_run_dir(tmp_path, node):
    """One folder per run and node used to stay in $TMPDIR for good (a 100-point sweep left 100)."""
    run = tmp_path / "run"
    tmp = node("n")
    with cc.node_copy_removed(run, CPU, 0, compiled=True):
        cache = cc.CompileCache(run, CPU, is_main=True)
        cache.load()
        _fill(cache.local, {"fxgraph/ab/entry": b"graph"})
        cache.save()
    assert not cache.node.exists() and not cache.node.parent.exists()
    assert cache.path.is_file()  # what the next launch loads
    with pytest.raises(RuntimeError), cc.node_copy_removed(run, CPU, 0, compiled=True):
        resumed = cc.CompileCache(run, CPU, is_main=True)
        assert resumed.load() is True and (resumed.local / "fxgraph/ab/entry").read_bytes() == b"graph"
        raise RuntimeError("a failing run")
    assert not resumed.node.exists()
    assert list(tmp.rglob("*")) == [tmp / f"hpctrain-inductor-{os.getuid()}"]
    with cc.node_copy_removed(run, CPU, 0, compiled=False):  # an eager run: nothing made, nothing removed
        pass
    assert cache.path.is_file()


def test_a_killed_runs_folder_is_removed_by_the_next_run_on_the_node(tmp_path, node):
    node("n")
    key = cc.cache_key(CPU)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    killed = cc.node_folder(key, tmp_path / "killed") / "rank0"
    host = socket.gethostname()
    _fill(killed, {cc.OWNER: f"{dead.pid} 1@boot {host}".encode(), "fxgraph/ab/entry": b"graph"})
    live = cc.node_folder(key, tmp_path / "live") / "rank1"
    _fill(live, {cc.OWNER: f"{os.getpid()} {cc.process_start(os.getpid())} {host}".encode()})
    elsewhere = cc.node_folder(key, tmp_path / "elsewhere") / "rank0"  # a $TMPDIR that another node shares
    _fill(elsewhere, {cc.OWNER: f"{dead.pid} 1@boot node7".encode()})
    old = cc.node_folder(key, tmp_path / "old-hpctrain") / "rank0"  # no owner file: not ours to judge
    _fill(old, {"fxgraph/ab/entry": b"graph"})
    with cc.node_copy_removed(tmp_path / "run", CPU, 0, compiled=True):
        assert not killed.parent.exists() and live.is_dir() and old.is_dir() and elsewhere.is_dir()


def test_nodes_that_share_a_tmpdir_keep_their_folders_apart(tmp_path, node, monkeypatch):
    """Local rank 0 of two nodes, one run dir, one $TMPDIR on a shared file system: each node its own folder (its
    owner file stays its own), and the first node to finish does not remove the folder the other still uses."""
    run = tmp_path / "run"
    node("shared")
    monkeypatch.setattr(socket, "gethostname", lambda: "node1")
    with cc.node_copy_removed(run, CPU, 0, compiled=True):
        first = cc.CompileCache(run, CPU, is_main=True)
        first.load()
        _fill(first.local, {"fxgraph/ab/entry": b"node1's graph"})
        monkeypatch.setattr(socket, "gethostname", lambda: "node2")
        with cc.node_copy_removed(run, CPU, 0, compiled=True):
            second = cc.CompileCache(run, CPU, is_main=False)
            second.load()
            assert second.local != first.local
            _fill(second.local, {"fxgraph/cd/entry": b"node2's graph"})
        assert not second.node.exists()  # node2 ended: its own folder went
        assert (first.local / "fxgraph/ab/entry").read_bytes() == b"node1's graph"
        assert "node1" in (first.local / cc.OWNER).read_text()
        monkeypatch.setattr(socket, "gethostname", lambda: "node1")
        first.save()
    assert not first.node.exists() and first.path.is_file()
    import tarfile

    with tarfile.open(first.path) as tar:
        assert tar.getnames() == ["rank0/fxgraph/ab/entry"]  # node1 packed its own folder only
