"""benchmarks/ddpm_throughput.py in its CPU smoke mode: both loops run, the table has a row for each with
positive numbers, the draw-price table is there, and --json writes the same numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import benchmark_module



@pytest.fixture(scope="module")
def bench():
    with benchmark_module("ddpm_throughput") as module:
        yield module


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _number(cell: str) -> float:
    return float(cell.split(" ")[0].replace(",", "").rstrip("%"))


@pytest.mark.timeout(120)
def test_cpu_smoke_run_prints_both_rows_with_positive_numbers(bench, tmp_path: Path, capsys):
    out = tmp_path / "ddpm.json"
    report = bench.main(["--device", "cpu", "--steps", "2", "--warmup", "1", "--repeats", "1", "--json", str(out)])
    text = capsys.readouterr().out
    assert "CPU SMOKE TEST" in text
    rows = {_cells(line)[0]: _cells(line) for line in text.splitlines() if line.startswith("| plain, eager, micro")
            or line.startswith("| hpctrain, eager, micro")}
    assert set(rows) == {"plain, eager, micro 8", "hpctrain, eager, micro 8"}, text
    for cells in rows.values():
        images_per_s, ms_per_step, host_ms, gflop, tflops = (_number(c) for c in cells[1:6])
        assert images_per_s > 0 and ms_per_step > 0 and gflop > 0 and tflops > 0, cells
        assert 0 < host_ms <= ms_per_step * 1.01, cells  # on the CPU the host does all the work
        assert _number(cells[-1]) > 0  # vs plain
    assert any(line.startswith("| positional: BatchInfo.randint") for line in text.splitlines()), text
    assert any(line.startswith("| plain: torch.randint") for line in text.splitlines()), text
    saved = json.loads(out.read_text())
    assert saved["smoke"] is True and [r["loop"] for r in saved["rows"]] == ["plain", "hpctrain"]
    assert saved["modes"] == ["eager"] and {r["mode"] for r in saved["rows"]} == {"eager"}
    assert saved["rows"][0]["flop_per_step"] == report["rows"][1]["flop_per_step"] > 0
    assert saved["draws"]["positional_us"] and saved["draws"]["plain_us"]


def test_graphed_modes_need_cuda_and_unknown_modes_are_named(bench):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main(["--device", "cpu", "--modes", "graphed"])
    with pytest.raises(SystemExit, match="choose from eager, compiled, graphed, graphed-compiled"):
        bench.main(["--device", "cpu", "--modes", "fast"])
