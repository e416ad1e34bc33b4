"""tools/slowfs.py: the slow passthrough reads back what it serves, pays its latency and its bandwidth cap,
and leaves no mount behind, also when the block using it raises. Skipped where FUSE cannot mount (the reason says
what is missing: /dev/fuse, root, fusermount3 or libfuse)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from tests.conftest import tool_module


@pytest.fixture(scope="module")
def slowfs():
    with tool_module("slowfs") as module:
        reason = module.unavailable()
        if reason:
            pytest.skip(reason)
        yield module


@pytest.fixture
def source(tmp_path: Path) -> Path:
    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "small.txt").write_bytes(b"hello\n")
    (tmp_path / "src" / "sub" / "big.bin").write_bytes(os.urandom(4_000_000))
    return tmp_path / "src"


def test_reads_back_what_it_serves_and_unmounts(slowfs, source, tmp_path):
    mount = tmp_path / "mnt"
    with slowfs.mounted(source, mount, slowfs.Slowness(meta_ms=0, bytes_per_s=0)):
        assert sorted(os.listdir(mount)) == ["small.txt", "sub"]
        assert (mount / "small.txt").read_bytes() == b"hello\n"
        assert (mount / "sub" / "big.bin").read_bytes() == (source / "sub" / "big.bin").read_bytes()
        with pytest.raises(OSError):  # read-only
            (mount / "new.txt").write_text("x")
    assert not slowfs.is_mounted(mount)


def test_metadata_latency_and_bandwidth_cap(slowfs, source, tmp_path):
    mount, meta_ms, cap = tmp_path / "mnt", 5.0, 20e6
    with slowfs.mounted(source, mount, slowfs.Slowness(meta_ms=meta_ms, bytes_per_s=cap)):
        started = time.perf_counter()
        for _ in range(40):
            os.stat(mount / "small.txt")
        assert time.perf_counter() - started >= 40 * meta_ms / 1000  # the kernel caches no attributes

        big = mount / "sub" / "big.bin"
        with open(big, "rb") as f:  # evict what listing or a previous read left in the page cache
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        before = slowfs.read_stats(mount)
        started = time.perf_counter()
        assert len(big.read_bytes()) == 4_000_000
        assert time.perf_counter() - started >= 4_000_000 / cap
        after = slowfs.read_stats(mount)
        assert after["read_bytes"] - before["read_bytes"] == 4_000_000
        assert after["opens"] - before["opens"] == 1
    assert not slowfs.is_mounted(mount)


def test_unmounts_and_ends_its_child_when_the_block_raises(slowfs, source, tmp_path):
    mount, held = tmp_path / "mnt", []
    try:
        with pytest.raises(ZeroDivisionError):
            with slowfs.mounted(source, mount, slowfs.Slowness(meta_ms=0)):
                held.append(open(mount / "small.txt", "rb"))  # still open: the plain unmount fails, the lazy one not
                1 / 0
        assert not slowfs.is_mounted(mount)
    finally:
        for f in held:
            with contextlib.suppress(OSError):  # its server is gone: a FLUSH may fail with ENOTCONN
                f.close()


def test_a_server_that_cannot_start_is_reported_with_its_stderr(slowfs, tmp_path):
    with pytest.raises(RuntimeError, match="is not a directory"):
        with slowfs.mounted(tmp_path / "missing", tmp_path / "mnt", slowfs.Slowness(), timeout_s=10):
            pass
