"""Node-local staging (data.stage_dir): the staged copy reads the same samples in the same order, is copied once
per node (also by processes starting together), is reused, resumed after an interruption, repaired when a staged
shard changed, refused when the source does not match its manifest, and never started without room for it."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpctrain.data import staging
from hpctrain.data.shards import INDEX, MANIFEST, write_split
from hpctrain.data.shardset import ShardDataset
from hpctrain.data.staging import STAGE_FOLDER, stage_split
from hpctrain.errors import UserError
from tests.conftest import tmpfs
from tests.unit.test_shards import _samples


@pytest.fixture
def split(tmp_path: Path) -> Path:
    write_split(tmp_path / "shared" / "train", "train", _samples(40), max_bytes=6_000)
    return tmp_path / "shared" / "train"


@pytest.fixture
def node(tmp_path: Path) -> Path:
    (tmp_path / "node").mkdir()
    return tmp_path / "node"


@pytest.fixture
def copies(monkeypatch) -> list[str]:
    """Names of the files copied (shards and index.json), in the copying process."""
    done: list[str] = []
    real = staging._copy_file

    def counted(src, dst, *args):
        done.append(src.name)
        return real(src, dst, *args)

    monkeypatch.setattr(staging, "_copy_file", counted)
    return done


def _shards(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.tar"))}


def test_the_staged_copy_reads_the_same_samples_in_the_same_order(split: Path, node: Path, copies: list[str]):
    here = ShardDataset(split, ["png", "cls"], window=8)
    staged = ShardDataset(split, ["png", "cls"], window=8, stage_dir=str(node))
    assert staged.split_dir.is_relative_to(node / STAGE_FOLDER) and staged.source_dir == split
    assert _shards(staged.split_dir) == _shards(split) and len(copies) == len(here.shard_names) + 1
    assert (staged.split_dir / MANIFEST).read_bytes() == (split / MANIFEST).read_bytes()
    assert (staged.split_dir / ".index-cache" / "meta.json").exists(), "the index arrays live beside the copy"
    assert staged.sizes == here.sizes
    for epoch in range(3):
        assert torch.equal(staged.epoch_order(5, epoch), here.epoch_order(5, epoch))
    for i in range(len(here)):
        (a, la), (b, lb) = here[i], staged[i]
        assert torch.equal(a, b) and la == lb
    assert str(split) in staged.where(staged.locate(0)), "errors name the shard the user can fix"


def test_a_second_use_reuses_the_copy_without_reading_it_again(split: Path, node: Path, copies: list[str],
                                                               monkeypatch):
    monkeypatch.setenv("NODE_LOCAL", str(node))
    first = stage_split(split, "$NODE_LOCAL")  # expanded at use, on the node
    mtimes = {p: p.stat().st_mtime_ns for p in first.iterdir()}
    copied = len(copies)
    assert stage_split(split, "${NODE_LOCAL}") == first  # the next process, or a requeued job on this node
    assert len(copies) == copied and {p: p.stat().st_mtime_ns for p in first.iterdir()} == mtimes


def test_an_interrupted_copy_is_resumed_and_verified(split: Path, node: Path, copies: list[str], monkeypatch):
    real, seen = staging._verify, []

    def fail_third(src, *args):  # a copy that dies on its third shard, while others are in flight
        seen.append(src)
        if len(seen) == 3:
            raise OSError(5, "Input/output error")
        return real(src, *args)

    monkeypatch.setattr(staging, "_verify", fail_third)
    monkeypatch.setattr(staging, "COPY_THREADS", 1)
    with pytest.raises(UserError, match="cannot stage .*Input/output error"):
        stage_split(split, str(node))
    target = next((node / STAGE_FOLDER).glob("*/*"))
    assert not (target / MANIFEST).exists(), "an unfinished copy is not marked complete"
    assert not list(target.glob(".*.part")), "no temporary file is left behind"
    # The two before the failure only: the failing copy stops the others itself (before, the copier went on with
    # the next shards until the reporting thread woke, which on a loaded machine was two shards later).
    kept = set(_shards(target))
    assert kept == {"train-000000.tar", "train-000001.tar"}
    (target / ".train-000005.tar.part").write_bytes(b"half a shard")  # a copier killed mid-shard
    (target / ".train-000000.tar.part").write_bytes(b"a stale part")  # beside a shard finished before the failure
    monkeypatch.setattr(staging, "_verify", real)
    copies.clear()
    assert stage_split(split, str(node)) == target
    assert set(copies) == set(_shards(split)) - kept | {INDEX}, "only what was missing is copied"
    assert _shards(target) == _shards(split) and not list(target.glob(".*.part"))


def test_a_staged_shard_that_changed_is_copied_again(split: Path, node: Path, copies: list[str], caplog):
    target = stage_split(split, str(node))
    with open(target / "train-000001.tar", "ab") as f:
        f.write(b"x")
    (target / "train-000002.tar").unlink()
    copies.clear()
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        assert stage_split(split, str(node)) == target
    assert sorted(copies) == ["index.json", "train-000001.tar", "train-000002.tar"]
    assert "train-000001.tar has" in caplog.text and "copying it again" in caplog.text
    assert _shards(target) == _shards(split)


def test_a_source_shard_that_does_not_match_its_manifest_is_refused(split: Path, node: Path):
    data = bytearray((split / "train-000001.tar").read_bytes())
    data[700] ^= 0xFF  # same size, other bytes
    (split / "train-000001.tar").write_bytes(bytes(data))
    with pytest.raises(UserError, match="train-000001.tar does not match the SHA-256 in its manifest"):
        stage_split(split, str(node))
    target = next((node / STAGE_FOLDER).glob("*/*"))
    assert not (target / "train-000001.tar").exists() and not (target / MANIFEST).exists()


def test_a_rewritten_set_is_a_new_copy_and_the_old_one_is_mentioned(split: Path, node: Path, caplog):
    old = stage_split(split, str(node))
    write_split(split, "train", _samples(50), max_bytes=6_000)
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        new = stage_split(split, str(node))
    assert new != old and new.parent == old.parent and old.exists()
    assert _shards(new) == _shards(split)
    assert "1 staged copy(ies) of an earlier version" in caplog.text and "staged " in caplog.text


def test_processes_starting_together_copy_each_shard_once(split: Path, node: Path, tmp_path: Path):
    """Three processes of a node start staging at once: one copies each file once, the others wait on the lock,
    saying how far the copy has got, and all end with the same complete copy."""
    log = tmp_path / "copies.log"
    code = ("import logging, sys, time; from pathlib import Path; from hpctrain.data import staging\n"
            "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
            "staging.PROGRESS_EVERY_S = 0.05\n"
            "real = staging._copy_file\n"
            "def logged(src, *args):\n"
            "    with open(sys.argv[3], 'a') as f: f.write(src.name + '\\n')\n"
            "    time.sleep(0.2); return real(src, *args)\n"
            "staging._copy_file = logged\n"
            "Path(sys.argv[4], f'ready-{sys.argv[5]}').touch()\n"
            "while not Path(sys.argv[4], 'go').exists(): time.sleep(0.01)\n"
            "print(staging.stage_split(Path(sys.argv[1]), sys.argv[2]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(split), str(node), str(log), str(tmp_path), str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready-*"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        (tmp_path / "go").touch()  # all three past their imports: they reach the lock together
        results = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:  # a process stuck on the lock must not outlive the test
            p.kill()
            p.wait()
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    assert len({out.strip() for out, _ in results}) == 1
    assert sorted(log.read_text().split()) == sorted([*_shards(split), INDEX]), "each file copied once, by one process"
    assert _shards(Path(results[0][0].strip())) == _shards(split)
    logs = sorted(err for _, err in results)
    assert sum("shard(s) already there reused" in err for err in logs) == 1
    waiting = [err for err in logs if "another process of this node is staging" in err]
    assert len(waiting) == 2 and all("waiting for the staged copy of" in err and " there" in err for err in waiting)


def test_no_copy_starts_without_room_for_it(split: Path, node: Path, monkeypatch):
    monkeypatch.setattr(staging, "free_bytes", lambda path: 1000)
    need = sum(p.stat().st_size for p in (split / n for n in _shards(split)))
    with pytest.raises(UserError, match=r"not enough space to stage .* to copy, 1 kB free in") as err:
        stage_split(split, str(node))
    assert "larger node-local disk" in err.value.hint and need > 1000
    assert not list(node.rglob("*.tar")) and not list(node.rglob("*.part"))


def test_a_disk_that_fills_up_during_the_copy_says_so(split: Path, tmp_path: Path, monkeypatch):
    with tmpfs(tmp_path / "small", "40k") as small:
        monkeypatch.setattr(staging, "free_bytes", lambda path: 10**12)  # another job fills the disk meanwhile
        with pytest.raises(UserError, match="filled up while staging"):
            stage_split(split, str(small))
        assert not list(small.rglob(".*.part"))


def test_a_stage_dir_that_is_missing_or_unset_is_named(split: Path, tmp_path: Path, monkeypatch):
    with pytest.raises(UserError, match=r"data.stage_dir .*/nowhere does not exist on"):
        ShardDataset(split, ["png"], stage_dir=str(tmp_path / "nowhere"))
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    with pytest.raises(UserError, match="the environment variable SLURM_TMPDIR is not set") as err:
        ShardDataset(split, ["png"], stage_dir="$SLURM_TMPDIR")
    assert "${SLURM_TMPDIR:-/local/scratch}" in err.value.hint
    assert stage_split(split, "${SLURM_TMPDIR:-" + str(tmp_path) + "}").is_relative_to(tmp_path / STAGE_FOLDER)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UserError, match=r"data.stage_dir .*/a-file is not a folder on"):
        ShardDataset(split, ["png"], stage_dir=str(tmp_path / "a-file"))
    # a missing source: its own message, before any staging
    with pytest.raises(UserError, match="shard directory .*nothing does not exist"):
        ShardDataset(tmp_path / "nothing", ["png"], stage_dir=str(tmp_path))


def test_a_stage_dir_on_a_network_filesystem_or_without_locks_is_refused(split: Path, node: Path, monkeypatch):
    """Where flock is per node or missing (BeeGFS, Lustre's localflock, NFS), the nodes' copiers would write the same
    files at once: a shared stage dir is refused, and a lock that fails is an error that says what to do."""
    monkeypatch.setattr(staging, "filesystem_type", lambda path: "lustre")
    with pytest.raises(UserError, match=r"data.stage_dir .* is on a lustre filesystem shared over the network") as err:
        stage_split(split, str(node))
    assert "node-local disk" in err.value.hint and not (node / STAGE_FOLDER).exists()
    monkeypatch.setattr(staging, "filesystem_type", lambda path: "ext4")

    def no_locks(fd, op):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(staging.fcntl, "flock", no_locks)
    with pytest.raises(UserError, match="cannot lock .* to stage .*: Function not implemented"):
        stage_split(split, str(node))


def test_a_stage_dir_that_cannot_be_written_is_named(split: Path, node: Path):
    (node / STAGE_FOLDER).write_text("a file where the folder would go")  # as root, the one way to fail a mkdir
    with pytest.raises(UserError, match="cannot create .* to stage") as err:
        stage_split(split, str(node))
    assert "data.stage_dir a folder this job may write to" in err.value.hint
