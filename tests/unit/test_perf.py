"""Pre-flight arithmetic and verdicts (the measurements themselves run in tests/dist/test_preflight.py)."""

from __future__ import annotations

import json

import pytest
import torch

from hpctrain.perf.measure import BandwidthRow, Straggler, bus_bandwidth, matmul_tflops, message_sizes
from hpctrain.perf.preflight import Thresholds, judge, render_markdown


def test_bus_bandwidth_is_nccl_tests_definition():
    assert bus_bandwidth(10.0, 2) == pytest.approx(10.0)  # 2(n-1)/n = 1
    assert bus_bandwidth(10.0, 4) == pytest.approx(15.0)  # 1.5
    assert bus_bandwidth(10.0, 8) == pytest.approx(17.5)  # 1.75
    assert bus_bandwidth(10.0, 1) == 0.0


def test_message_sizes_from_1kib_to_1gib():
    sizes = message_sizes(1 << 10, 1 << 30)
    assert sizes[0] == 1024 and sizes[-1] == 1 << 30 and len(sizes) == 11
    assert all(b == 4 * a for a, b in zip(sizes, sizes[1:]))
    assert message_sizes(1000, 5000) == [1000, 4000]


def test_matmul_tflops_is_positive_on_cpu():
    assert 0 < matmul_tflops(torch.device("cpu"), 64, torch.float32, iters=2) < 100


def _rows(busbw: float) -> list[BandwidthRow]:
    return [BandwidthRow(1024, 50.0, 0.02, 0.02), BandwidthRow(1 << 20, 900.0, busbw, busbw)]


def test_verdicts_follow_the_thresholds():
    even = Straggler([1.0, 1.02], 1, 1.0)
    ok = judge(_rows(5.0), [1.0, 1.1], even, Thresholds(min_busbw_gbps=4, min_tflops=0.5), world=2)
    assert [c.status for c in ok] == ["pass", "pass", "pass"]
    bad = judge(_rows(5.0), [1.0, 0.2], Straggler([1.0, 1.0, 2.0], 2, 2.0), Thresholds(min_busbw_gbps=50, min_tflops=0.5), 3)
    assert [c.status for c in bad] == ["fail", "fail", "fail"]
    assert "below the required 50 GB/s" in bad[0].detail and "slowest rank 1: 0.20" in bad[1].detail
    assert "rank 2 takes 2.00x" in bad[2].detail
    assert judge(_rows(5.0), [1.0], Straggler([1.0, 1.3], 1, 1.3), Thresholds(), 2)[2].status == "warn"
    assert judge([], [1.0], Straggler([1.0], 0, 1.0), Thresholds(min_busbw_gbps=99), 1)[0].status == "skip"


def test_markdown_report_holds_every_table():
    env = {"host": "n1", "torch": "2.x", "cuda": None, "nccl": None, "gpus": [], "cpus_usable": 2, "interfaces": ["lo"]}
    report = {"time": "T", "world_size": 2, "backend": "gloo", "device": "cpu", "dtype": "float32", "matmul_n": 64,
              "checks": [{"name": "stragglers", "status": "warn", "detail": "d"}],
              "bandwidth": [{"bytes": 1 << 20, "time_us": 900.0, "algbw_gbps": 1.1651, "busbw_gbps": 1.1651}],
              "tflops_per_rank": [0.5, 0.25], "straggler": {"times_s": [0.1, 0.2]}, "ranks": [env, {**env, "host": "n2"}]}
    text = render_markdown(report)
    assert "| stragglers | WARN | d |" in text
    assert "| 1 MiB | 900.0 | 1.165 | 1.165 |" in text
    assert "| 1 | n2 | 0.25 | 0.2000 | - | 2 |" in text


def test_one_process_reports_no_bandwidth_table():
    """A one-rank all-reduce moves nothing: the report says so instead of a table of memory-speed 'bandwidths'."""
    env = {"host": "n1", "torch": "2.x", "cuda": None, "nccl": None, "gpus": [], "cpus_usable": 2, "interfaces": ["lo"]}
    report = {"time": "T", "world_size": 1, "backend": "none", "device": "cuda", "dtype": "bfloat16", "matmul_n": 64,
              "checks": [], "bandwidth": [], "tflops_per_rank": [700.0], "straggler": {"times_s": [0.1]},
              "ranks": [env]}
    text = render_markdown(report)
    assert "algbw" not in text and "Not measured: one process" in text and "--nproc-per-node N" in text


def probe(files: int, mean: float, mbps: float) -> dict:
    return {"files": files, "mean_file_bytes": mean, "opens_per_s": 1000.0, "read_mbps": mbps, "bytes_read": 1 << 20}


def test_data_probe_verdicts():
    from hpctrain.perf.preflight import judge_data

    assert judge_data([], Thresholds()) == []
    ok = judge_data([probe(10, 1 << 30, 900.0), probe(10, 1 << 30, 400.0)], Thresholds(min_read_mbps=100))
    assert ok[0].status == "pass" and "slowest rank 1: 400 MB/s" in ok[0].detail and "(20 files, 1 GiB" in ok[0].detail
    slow = judge_data([probe(10, 1 << 30, 50.0)], Thresholds(min_read_mbps=100))
    assert slow[0].status == "fail" and "below the required 100 MB/s" in slow[0].detail
    small = judge_data([probe(50_000, 20_000, 500.0)], Thresholds())
    assert small[0].status == "warn" and "hpctrain shard" in small[0].detail
    assert judge_data([probe(0, 0, 0.0)], Thresholds())[0].status == "fail"


def _fake_rank(monkeypatch, rank: int, world: int, listing: list[str]):
    """Rank `rank` of `world` without a process group: barriers pass, and a broadcast from rank 0 hands every
    other rank rank 0's listing (computed before counting starts)."""
    import dataclasses

    import torch.distributed as dist

    from hpctrain.dist.runtime import single_process_runtime

    def broadcast_object_list(box, src=0, **_):
        assert src == 0
        if rank != 0:
            box[0] = (list(listing), "")

    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    return dataclasses.replace(single_process_runtime(torch.device("cpu")), launcher="torchrun", rank=rank,
                               world_size=world, local_rank=rank, local_world_size=world, backend="gloo")


def _data_tree(root) -> int:
    n = 0
    for d in range(4):
        sub = root / f"part{d}" / "deeper" if d % 2 else root / f"part{d}"
        sub.mkdir(parents=True)
        for i in range(10):
            (sub / f"sample-{i:03d}.bin").write_bytes(b"x" * (100 + n))
            n += 1
    return n


@pytest.mark.parametrize("world", [1, 4])
def test_data_probe_stats_only_each_ranks_share(tmp_path, monkeypatch, world):
    """512 ranks x 1M files must not be 512M stats: rank 0 lists without a stat per file, broadcasts the names,
    and each rank stats its own share only (doctor --perf --data exists to detect metadata storms)."""
    import os

    from hpctrain.perf import measure

    n = _data_tree(tmp_path)
    listing = measure.list_files(str(tmp_path))
    assert len(listing) == n
    seen: dict[int, int] = {}
    for rank in range(world):
        runtime = _fake_rank(monkeypatch, rank, world, listing)
        calls = []
        real_stat, real_lstat = os.stat, os.lstat
        monkeypatch.setattr(os, "stat", lambda p, *a, **k: calls.append(str(p)) or real_stat(p, *a, **k))
        monkeypatch.setattr(os, "lstat", lambda p, *a, **k: calls.append(str(p)) or real_lstat(p, *a, **k))
        probe = measure.data_read_probe(runtime, str(tmp_path), max_bytes=1 << 20)
        monkeypatch.setattr(os, "stat", real_stat)
        monkeypatch.setattr(os, "lstat", real_lstat)
        share = -(-n // world)
        assert probe.files in (n // world, share)
        assert len(calls) <= share, f"rank {rank} of {world} made {len(calls)} stat calls for {n} files"
        assert len(set(calls)) == len(calls)  # no file stat twice
        seen[rank] = probe.bytes_read
    assert sum(seen.values()) == sum(100 + i for i in range(n))  # together the ranks read every file once


def test_data_listing_skips_directories_and_what_is_not_a_file(tmp_path):
    import os

    from hpctrain.dist.runtime import single_process_runtime
    from hpctrain.perf.measure import list_files, my_files

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x.bin").write_bytes(b"12345")
    (tmp_path / "y.bin").write_bytes(b"1")
    (tmp_path / "empty").mkdir()
    os.symlink(tmp_path / "a", tmp_path / "link-to-dir")
    os.mkfifo(tmp_path / "fifo")  # opening it would block: dropped by the stat of the rank that owns it
    assert list_files(str(tmp_path)) == ["a/b/x.bin", "fifo", "link-to-dir", "y.bin"]
    files = my_files(single_process_runtime(torch.device("cpu")), str(tmp_path))
    assert [(os.path.relpath(p, tmp_path), size) for p, size in files] == [("a/b/x.bin", 5), ("y.bin", 1)]


def test_dense_peaks_by_device_name():
    from hpctrain.perf.peaks import dense_peak, describe
    from hpctrain.perf.preflight import judge, peak_report

    assert dense_peak("NVIDIA H100 80GB HBM3").tflops == 989.0  # SXM
    assert dense_peak("NVIDIA H100 PCIe").tflops == 756.0
    assert dense_peak("NVIDIA H100 NVL").gpu == "H100 NVL"
    assert dense_peak("NVIDIA H200").gpu == "H200 SXM" and dense_peak("NVIDIA GH200 480GB").gpu == "GH200"
    assert dense_peak("NVIDIA A100-SXM4-80GB").tflops == 312.0 and dense_peak("NVIDIA A100 80GB PCIe").tflops == 312.0
    assert dense_peak("NVIDIA A10").gpu == "A10" and dense_peak("NVIDIA A10G") is None  # A10 is not a prefix match
    assert dense_peak("NVIDIA L40S").tflops == 362.0 and dense_peak("NVIDIA L4").gpu == "L4"
    assert dense_peak("Tesla V100-SXM2-32GB").dtype == "fp16" and dense_peak("Tesla V100-PCIE-16GB").tflops == 112.0
    assert dense_peak("NVIDIA GeForce GTX 1080") is None
    assert describe(494.5, "NVIDIA H100 80GB HBM3", "bf16") == "50% of the H100 SXM's dense bf16 peak (989 TFLOP/s)"
    assert describe(1.0, "Some GPU", "bf16") == "peak unknown for 'Some GPU'"
    assert peak_report(156.0, "NVIDIA A100-SXM4-40GB", "bf16")["fraction"] == pytest.approx(0.5)
    assert peak_report(1.0, "Some GPU", "bf16")["gpu"] == "unknown"
    note = "71% of the H100 SXM's dense bf16 peak"
    detail = judge([], [700.0], Straggler([1.0], 0, 1.0), Thresholds(), 1, note)[1].detail
    assert detail.endswith("; 71% of the H100 SXM's dense bf16 peak")


def test_an_unreadable_data_dir_fails_every_rank_with_the_reason(tmp_path, monkeypatch):
    """Rank 0 cannot list --data: every rank raises the same UserError (none waits for a list that never comes);
    an unreadable subdirectory is skipped, as Path.rglob skipped it."""
    import os

    from hpctrain.errors import UserError
    from hpctrain.perf import measure

    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.bin").write_bytes(b"x")
    real_scandir = os.scandir

    def scandir(path):
        if str(path).endswith("locked") or str(path) == str(tmp_path / "gone"):
            raise PermissionError(13, "Permission denied")
        return real_scandir(path)

    monkeypatch.setattr(measure.os, "scandir", scandir)
    (tmp_path / "locked").mkdir()
    assert measure.list_files(str(tmp_path)) == ["ok/a.bin"]
    from hpctrain.dist.runtime import single_process_runtime

    runtime = single_process_runtime(torch.device("cpu"))
    with pytest.raises(UserError, match="cannot list --data .*gone: Permission denied"):
        measure.my_files(runtime, str(tmp_path / "gone"))


def test_a_file_this_rank_cannot_open_is_skipped_not_raised(tmp_path, monkeypatch):
    """Raised on one rank alone, the others would wait for it at the next collective."""
    from hpctrain.dist.runtime import single_process_runtime
    from hpctrain.perf import measure

    for i in range(3):
        (tmp_path / f"f{i}.bin").write_bytes(b"x" * 100)
    real_open = measure.os.open

    def refusing_open(path, flags, *a):
        if str(path).endswith("f1.bin"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(measure.os, "open", refusing_open)
    probe = measure.data_read_probe(single_process_runtime(torch.device("cpu")), str(tmp_path), 10_000)
    assert probe.bytes_read == 200


def test_a_one_process_preflight_measures_no_bandwidth(tmp_path, capsys):
    from hpctrain.dist.runtime import single_process_runtime
    from hpctrain.perf.preflight import Settings, run_preflight

    code = run_preflight(single_process_runtime(torch.device("cpu")), Settings(max_bytes=1 << 12, matmul_n=64),
                         Thresholds(), tmp_path)
    report = json.loads((tmp_path / "preflight.json").read_text())
    assert code == 0 and report["world_size"] == 1 and report["bandwidth"] == []
    assert report["checks"][0] == {"name": "all-reduce bandwidth", "status": "skip",
                                   "detail": "one process: nothing to measure"}
    assert "Not measured: one process" in capsys.readouterr().out
