"""Pre-flight arithmetic and verdicts (the measurements themselves run in tests/dist/test_preflight.py)."""

from __future__ import annotations

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
