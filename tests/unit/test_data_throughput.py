"""benchmarks/data_throughput.py on a small generated set, one repeat, two concurrent readers: every row of the
table is there, and each pass read the whole epoch between its readers. Through the slow FUSE mount too where
FUSE can mount here (else local disk only)."""

from __future__ import annotations

import sys

from tests.conftest import benchmark_module, tool_module


def test_small_run_has_a_row_per_file_system_and_pipeline(tmp_path, monkeypatch, capsys):
    with tool_module("slowfs") as slowfs:
        fs = "local" if slowfs.unavailable() else "local,slow"
    with benchmark_module("data_throughput") as bench:
        monkeypatch.setattr(sys, "argv", ["data_throughput.py", "--images", "600", "--repeats", "1", "--readers", "2",
                                          "--fs", fs, "--workdir", str(tmp_path), "--workers", "0", "--warm"])
        # --warm: no drop_caches=2 of the whole machine's dentries in the middle of the suite
        bench.main()
    out = capsys.readouterr().out
    for name in fs.split(","):
        for pipeline in bench.PIPELINES:
            assert f"| {name} | 2 | {pipeline} |" in out
    # per-file and webdataset read every sample; hpctrain drops the last partial global batch (2 x 256)
    assert "'local/2/per-file': 600" in out and "'local/2/webdataset': 600" in out and "'local/2/hpctrain': 512" in out
