"""benchmarks/faceseg_decode.py: the face-parsing data path's per-core rates on small generated shards (every stage
and the loader measured, positive), and the cores-per-GPU arithmetic and its verdict."""

from __future__ import annotations

import json

import pytest

from tests.conftest import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("faceseg_decode") as module:
        yield module


@pytest.mark.timeout(180)
def test_a_small_run_measures_every_stage_and_the_loader(bench, tmp_path, capsys):
    out = tmp_path / "decode.json"
    result = bench.main(["--faces", "60", "--size", "64", "--samples", "12", "--repeats", "1", "--batch", "8", "--loader-batch", "8",
                         "--workers", "1", "--workdir", str(tmp_path / "w"), "--json", str(out)])
    assert set(result["stages"]) == {"read", "cpu-decode", "gpu-decode, CPU share", "collate"}
    assert all(rate > 0 for rate in result["stages"].values())
    assert result["stages"]["read"] > result["stages"]["cpu-decode"]  # decoding costs more than reading bytes
    assert result["loaders"]["cpu-decode"][1] > 0 and result["loaders"]["gpu-decode, CPU share"][1] > 0
    assert result["per_core"]["cpu-decode"] == result["loaders"]["cpu-decode"][1]  # the loader's, not the stage's
    assert json.loads(out.read_text())["stages"] == pytest.approx(result["stages"])
    text = capsys.readouterr().out
    assert "| cpu-decode |" in text and "| cpu-decode | 1 (on" in text and "loader cores" in text


def test_cores_per_gpu_and_the_verdict(bench):
    assert bench.cores_per_gpu(500.0) == {"batch 96": 4.0, "micro 16": 2.4}
    stages = {"cpu-decode": 600.0, "gpu-decode, CPU share": 900.0}
    assert bench.per_core(stages, {"cpu-decode": {1: 450.0, 2: 800.0}}) == {"cpu-decode": 450.0,
                                                                            "gpu-decode, CPU share": 900.0}
    cheaper = bench.verdict({"cpu-decode": 500.0, "gpu-decode, CPU share": 1000.0})
    assert "needs 4 loader cores with the CPU decode path and 2 with nvJPEG" in cheaper[0]
    assert "at least 5 cores per GPU can decode on the CPU" in cheaper[1] and "with 3 to 4 per GPU" in cheaper[1]
    dearer = bench.verdict({"cpu-decode": 1000.0, "gpu-decode, CPU share": 900.0})
    assert "nvJPEG saves no CPU time here" in dearer[1]
