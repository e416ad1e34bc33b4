"""benchmarks/faceseg_throughput.py in its CPU smoke mode: the model-only loops and both end-to-end paths run
(faces generated and sharded), the table has a row for each with positive numbers, the goals table is there, and
--json writes the same numbers; its pure helpers (ratios, goals, table) directly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("faceseg_throughput") as module:
        yield module


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _number(cell: str) -> float:
    return float(cell.split(" ")[0].replace(",", "").rstrip("%"))


ROWS = ("plain", "hpctrain", "e2e cpu-decode", "e2e gpu-decode")
H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.timeout(180)
def test_cpu_smoke_run_prints_every_row_with_positive_numbers(bench, tmp_path: Path, capsys):
    out = tmp_path / "faceseg.json"
    # The smallest sizes: others share this machine's 2 cores.
    report = bench.main(["--device", "cpu", "--batches", "2", "--size", "32", "--steps", "1", "--warmup", "1",
                         "--repeats", "1", "--samples", "4", "--faces", "10", "--e2e", "cpu,gpu",
                         "--workdir", str(tmp_path / "work"), "--json", str(out)])
    text = capsys.readouterr().out
    assert "CPU SMOKE TEST" in text and "| torch " in text and " UTC |" in text
    lines = text.splitlines()
    assert "| loop, batch | images/s | ms/step | GFLOP/image | TFLOP/s | % peak | peak GiB | vs |" in lines
    rows = {_cells(line)[0]: _cells(line) for line in lines
            if line.startswith("| ") and _cells(line)[0].endswith(", batch 2")}
    assert set(rows) == {f"{name}, batch 2" for name in ROWS}, text
    for name, cells in rows.items():
        assert len(cells) == 8, cells
        images_per_s, ms_per_step, gflop, tflops = (_number(c) for c in cells[1:5])
        assert images_per_s > 0 and ms_per_step > 0 and gflop > 0 and tflops > 0, cells
        assert cells[5] == "-" and cells[6] == "-", cells  # no peak, no CUDA memory on a CPU
        if name.startswith("plain"):
            assert cells[7] == "reference"
        else:
            assert _number(cells[7]) > 0 and cells[7].endswith("of plain" if "hpctrain" in name else "of model-only")
    assert "| goal | batch 2 |" in lines, text
    assert any(line.startswith("| model-only (hpctrain) >= 2,000 images/s | ") for line in lines), text
    assert "e2e gpu-decode without CUDA" in text

    saved = json.loads(out.read_text())
    assert saved["smoke"] is True and saved["reference"] is False and saved["precision"] == "fp32"
    assert [r["loop"] for r in saved["rows"]] == list(ROWS)
    flops = {r["flop_per_step"] for r in saved["rows"]}
    assert len(flops) == 1 and flops.pop() == report["rows"][0]["flop_per_step"] > 0  # one model, one count
    assert saved["data"]["faces"] == 10 and saved["data"]["train_samples"] == 8 and saved["data"]["workers"] == 0
    assert saved["model"]["backbone"] == "resnet18" and saved["model"]["parameters"] > 0
    assert len(saved["goals"]) == 4 and all(g["value"] is not None for g in saved["goals"])
    # The shards stay in --workdir and are reused.
    assert (tmp_path / "work" / "shards" / "train").is_dir() and not (tmp_path / "work" / "faces").exists()


def test_ratios_and_peak_fraction(bench):
    assert bench.paired_ratio([10.0, 30.0, 20.0], [10.0, 20.0, 40.0]) == 1.0
    assert bench.median_ratio([8.0, 9.0, 10.0], [10.0, 12.0, 20.0]) == 0.75
    with pytest.raises(ValueError):
        bench.paired_ratio([1.0], [1.0, 2.0])
    peak = bench.dense_peak(H100)
    assert bench.peak_fraction(247.25, peak, "bf16") == pytest.approx(0.25)
    assert bench.peak_fraction(247.25, peak, "fp32") is None and bench.peak_fraction(1.0, None, "bf16") is None


def _settings(bench, **changes):
    return dataclasses.replace(bench.settings(bench.parser().parse_args(["--device", "cpu"])), **changes)


def test_settings_defaults_and_reference(bench):
    s = bench.settings(bench.parser().parse_args(["--device", "cpu"]))
    assert s.smoke and (s.backbone, s.size, s.aspp, s.decoder) == ("resnet18", 64, 32, 32) and s.batches == (4,)
    assert s.e2e == ("cpu",) and s.workers == 0 and not s.reference
    s = bench.settings(bench.parser().parse_args(["--device", "cpu", "--backbone", "resnet34", "--size", "96",
                                                  "--batches", "2", "6", "--e2e", "none"]))
    assert (s.backbone, s.size, s.batches, s.e2e) == ("resnet34", 96, (2, 6), ())
    cuda_reference = _settings(bench, device=torch.device("cuda", 0), name=H100, smoke=False, **{
        "backbone": "resnet101", "size": 256, "output_stride": 16, "aspp": 256, "decoder": 256})
    assert cuda_reference.reference and cuda_reference.precision == "bf16"
    for bad in (["--e2e", "disk"], ["--faces", "3"], ["--batches", "0"], ["--samples", "2", "--batches", "4"]):
        with pytest.raises(SystemExit):
            bench.settings(bench.parser().parse_args(["--device", "cpu", *bad]))


def test_the_nvjpeg_row_runs_eagerly_under_graphed_and_the_settings_reach_hpctrain(bench):
    graphed = _settings(bench, step_mode="graphed", channels_last=False, cudnn_benchmark=True)
    assert bench.step_mode_for(graphed, "gpu") == "eager"  # its batches hold JPEG bytes: no graph can take them
    assert bench.step_mode_for(graphed, "cpu") == bench.step_mode_for(graphed, "") == "graphed"
    assert bench.step_mode_for(dataclasses.replace(graphed, compile=True), "gpu") == "compiled"
    config = bench.overrides(graphed, 16, "/tmp/x", "gpu", "/tmp/shards")
    assert {"train.step_mode=eager", "train.channels_last=false", "train.cudnn_benchmark=on"} <= set(config)


def _measured(bench, name: str, batch: int, seconds: list[float], resident: int = 0, transient: int = 0):
    return bench.Measured(name, batch, seconds, resident, transient)


def test_rows_goals_and_table(bench):
    s = _settings(bench, device=torch.device("cuda", 0), name=H100, smoke=False, steps=10, repeats=2, batches=(16,),
                  backbone="resnet101", size=256, output_stride=16, aspp=256, decoder=256, e2e=("cpu", "gpu"))
    flops = 16 * 118 * 10**9
    measured = {  # images/s: plain 2,000 and 2,000; hpctrain 1,970 and 1,990; e2e 1,800 and 1,500
        "plain": _measured(bench, "plain", 16, [0.08, 0.08], 2 << 30, 1 << 30),
        "hpctrain": _measured(bench, "hpctrain", 16, [160 / 1970, 160 / 1990], 2 << 30, 1 << 30),
        "e2e cpu-decode": _measured(bench, "e2e cpu-decode", 16, [160 / 1800, 160 / 1800]),
        "e2e gpu-decode": _measured(bench, "e2e gpu-decode", 16, [160 / 1500, 160 / 1500]),
    }
    table = bench.rows(s, [(measured, flops)])
    by = {r["loop"]: r for r in table}
    assert by["plain"]["vs"] is None and by["hpctrain"]["vs"] == pytest.approx(0.99)
    assert by["e2e cpu-decode"]["vs"] == pytest.approx(1800 / 1980) and by["e2e gpu-decode"]["vs_what"] == "model-only"
    assert by["plain"]["gflop_per_image"] == pytest.approx(118) and by["plain"]["tflops_median"] == pytest.approx(236)
    assert by["plain"]["peak_memory_bytes"] == 3 << 30

    goal_rows = bench.goals(table)
    met = {g["goal"]: g["met"] for g in goal_rows}
    assert met == {"model-only (hpctrain) >= 2,000 images/s": False, "hpctrain >= 0.97 x plain": True,
                   "e2e cpu-decode >= 90% of model-only": True, "e2e gpu-decode >= 90% of model-only": False}

    text = bench.render(s, ["# head"], table, goal_rows)
    lines = text.splitlines()
    assert lines[0] == "# head" and "| hpctrain, batch 16 | 1,980 [1,970, 1,990] | 8.08 | 118.00 | 234 | 23.6% | " \
        "3.00 | 0.990 of plain |" in lines, text
    assert "| e2e gpu-decode, batch 16 | 1,500 [1,500, 1,500] | 10.67 | 118.00 | 177 | 17.9% | 0.00 | " \
        "0.758 of model-only |" in lines, text
    assert "| plain, batch 16 | 2,000 [2,000, 2,000] | 8.00 | 118.00 | 236 | 23.9% | 3.00 | reference |" in lines
    assert "| model-only (hpctrain) >= 2,000 images/s | missed: 1,980 |" in lines
    assert "| e2e cpu-decode >= 90% of model-only | met: 0.909 |" in lines
    assert "of the H100 SXM's dense bf16 peak, 989 TFLOP/s" in text


def test_continuing_loader_keeps_its_iterator_within_an_epoch(bench):
    class Sampler:
        epoch, start_step = 0, 0

    class Loader:
        starts = 0

        def __len__(self):
            return 4

        def __iter__(self):
            Loader.starts += 1
            return iter(range(Sampler.start_step, 4))

        def take_skipped(self):
            return []

    sampler = Sampler()
    loader = bench.ContinuingLoader(Loader(), sampler)
    it = iter(loader)
    assert [next(it), next(it)] == [0, 1]
    sampler.start_step = 2  # the next window goes on where this one stopped: the same iterator
    it = iter(loader)
    assert next(it) == 2 and loader.starts == 1
    sampler.epoch, sampler.start_step = 1, 0  # a new epoch: a new iterator
    assert list(iter(loader)) == [0, 1, 2, 3] and loader.starts == 2 and len(loader) == 4
