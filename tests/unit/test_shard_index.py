"""The memory-mapped shard index: the same samples as index.json says, built once per shard set (or per node when
the shard folder is read-only), rebuilt when index.json changes, pickled as a path, and the shard sizes checked
once per node and launch rather than by every rank."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpctrain.data import shardset
from hpctrain.data.shard_index import CACHE_DIR, load_shard_index
from hpctrain.data.shards import INDEX, index_directory, write_split
from hpctrain.data.shardset import ShardDataset, load_index
from hpctrain.errors import UserError
from tests.unit.test_shards import _samples


@pytest.fixture
def split(tmp_path: Path) -> Path:
    write_split(tmp_path / "train", "train", _samples(40), max_bytes=6_000)
    return tmp_path / "train"


def test_every_sample_is_where_index_json_says(split: Path):
    ds = ShardDataset(split, ["png", "cls"])
    want = [(s, key, members) for s, shard in enumerate(load_index(split)["shards"])
            for key, members in zip(shard["keys"], zip(*[[(ext, tuple(c)) for c in col]
                                                         for ext, col in shard["members"].items()]))]
    assert len(ds) == len(want) == 40 and len(ds.shard_names) > 3
    for i, (shard, key, members) in enumerate(want):
        loc = ds.locate(i)
        assert (loc.shard, loc.key, loc.members) == (shard, key, dict(members)), i
    assert [int(ds[i][1]) for i in range(40)] == [i % 10 for i in range(40)]
    assert (split / CACHE_DIR / "meta.json").exists()


def test_a_worker_receives_a_path_not_the_index(split: Path, tmp_path: Path):
    small = pickle.dumps(ShardDataset(split, ["png", "cls"]))
    write_split(tmp_path / "big", "train", _samples(400), max_bytes=6_000)
    big = ShardDataset(tmp_path / "big", ["png", "cls"])
    assert abs(len(pickle.dumps(big)) - len(small)) < 40 * len(big.shard_names)  # names only, not per sample
    copy = pickle.loads(pickle.dumps(big))
    assert isinstance(copy._index.members["png"], np.memmap)
    assert [copy.locate(i) for i in (0, 199, 399)] == [big.locate(i) for i in (0, 199, 399)]


def test_a_changed_index_json_is_read_again(split: Path):
    assert ShardDataset(split, ["png"]).locate(0).key == "000000"
    index = json.loads((split / INDEX).read_text())
    index["shards"][0]["keys"][0] = "renamed"
    (split / INDEX).write_text(json.dumps(index))
    os.utime(split / INDEX, ns=(1, 1))  # a different mtime even on a coarse clock
    assert ShardDataset(split, ["png"]).locate(0).key == "renamed"


def test_a_read_only_shard_folder_gets_a_node_local_copy(split: Path, monkeypatch, tmp_path: Path):
    import tempfile

    (tmp_path / "node").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    real_mkdtemp = tempfile.mkdtemp

    def read_only_split(prefix=None, dir=None):  # noqa: A002 - tempfile's own parameter name
        if Path(dir) == split:  # as root a chmod would not stop us: refuse as a read-only file system does
            raise PermissionError(13, "Read-only file system", str(dir))
        return real_mkdtemp(prefix=prefix, dir=dir)

    monkeypatch.setattr(tempfile, "mkdtemp", read_only_split)
    ds = ShardDataset(split, ["png", "cls"])
    assert ds.locate(5).key == "000005" and not (split / CACHE_DIR).exists()
    assert len(list((tmp_path / "node" / "hpctrain-index").glob("*/meta.json"))) == 1
    assert ShardDataset(split, ["png"]).locate(39).key == "000039"  # found there again, not rebuilt
    assert len(list((tmp_path / "node" / "hpctrain-index").iterdir())) == 1


def test_processes_building_at_once_agree_on_one_index(split: Path):
    code = ("import sys; from pathlib import Path; from hpctrain.data.shard_index import load_shard_index; "
            "i = load_shard_index(Path(sys.argv[1]), Path(sys.argv[1]) / 'index.json'); print(len(i), i.key(39))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(split)], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    try:
        assert [p.communicate(timeout=60)[0].strip() for p in procs] == ["40 000039"] * 4
    finally:
        for p in procs:  # a hung builder must not outlive the test
            p.kill()
            p.wait()
    assert not [p for p in split.iterdir() if p.name.startswith(f".{CACHE_DIR}.")], "a temporary folder was left"


def test_a_malformed_index_json_says_to_re_index(split: Path):
    (split / INDEX).write_text('{"shards": [{"name": "x.tar"}]}')
    with pytest.raises(UserError, match="not a valid shard index.*KeyError"):
        ShardDataset(split, ["png"])


def test_sizes_are_checked_once_per_node_and_launch(split: Path, monkeypatch, tmp_path: Path):
    (tmp_path / "node").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    checks = []
    real = shardset._check_sizes
    monkeypatch.setattr(shardset, "_check_sizes", lambda d: checks.append(d) or real(d))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-1")
    for _ in range(3):  # the ranks of one node
        ShardDataset(split, ["png"])
    assert len(checks) == 1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-2")  # the next launch checks again
    ShardDataset(split, ["png"])
    assert len(checks) == 2
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    ShardDataset(split, ["png"])  # one process started by hand: always
    ShardDataset(split, ["png"])
    assert len(checks) == 4
    markers = sorted((tmp_path / "node" / "hpctrain-index").glob("sizes-*"))
    assert len(markers) == 4  # a marker and a lock per launch
    for old in markers[:2]:
        os.utime(old, (1, 1))  # launches long gone
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-3")
    ShardDataset(split, ["png"])
    assert len(checks) == 5 and len(list((tmp_path / "node" / "hpctrain-index").glob("sizes-*"))) == 4
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with open(split / "train-000000.tar", "ab") as f:  # and a wrong size is still found
        f.write(b"x")
    with pytest.raises(UserError, match="truncated or was rewritten"):
        ShardDataset(split, ["png"])


def test_index_only_sets_from_other_writers_too(tmp_path: Path, split: Path):
    """Shards indexed by `hpctrain shard --index-only` (another tool wrote them) get the same arrays."""
    (split / INDEX).unlink()
    (split / "manifest.json").unlink()
    assert index_directory(split) == 40
    index = load_shard_index(split, split / INDEX)
    assert len(index) == 40 and index.key(0) == "000000"


def test_the_start_up_benchmark_prints_its_table(tmp_path: Path, monkeypatch, capsys):
    """benchmarks/archive/2026-11/index_startup.py on a small generated set, one repeat: the set it writes is one
    hpctrain reads, and the table has both rows of this tree."""
    from tests.conftest import benchmark_module

    with benchmark_module("archive/2026-11/index_startup") as bench:
        monkeypatch.setattr(sys, "argv", ["index_startup.py", "--samples", "3000", "--shards", "30", "--repeats", "1",
                                          "--workdir", str(tmp_path)])
        bench.main()
    out = capsys.readouterr().out
    assert "3,000 samples in 30 shards" in out
    assert "| this tree, first |" in out and "| this tree, then |" in out
    ds = ShardDataset(tmp_path / "3000-30" / "train", ["png", "cls"])
    assert len(ds) == 3000 and ds.locate(2999).key == "000002999"
