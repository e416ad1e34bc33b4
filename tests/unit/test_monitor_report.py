"""Monitor log parsers, the top filter, and `hpctrain report` on a run dir built from real-format logs."""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.monitor.parse import parse_dmon, parse_parsable, parse_top
from hpctrain.monitor.report import observations, summary_facts, load_run
from hpctrain.monitor.sidecars import keep_top_lines, monitor_commands

DATA = Path(__file__).parent / "data"


def test_top_parser_skips_the_since_boot_line_and_reads_cpu_and_memory():
    top = parse_top((DATA / "top_sample.log").read_text())
    assert top.cpu_busy == pytest.approx([83.3, 100.0])
    assert top.seconds == [1.0, 2.0]
    assert top.mem_used_gib == pytest.approx([1065.8 / 1024, 1896.6 / 1024])
    assert top.mem_total_gib == pytest.approx(24105.1 / 1024)


def test_top_parser_survives_midnight():
    text = "\n".join(f"top - {t} up 1 day\n%Cpu(s): 1.0 us, 0.0 sy, 0.0 ni, {idle} id,"
                     for t, idle in (("23:59:58", 99.0), ("23:59:59", 50.0), ("00:00:01", 25.0)))
    assert parse_top(text).seconds == [1.0, 3.0]


def test_dmon_parser_reads_columns_by_header_and_skips_torn_lines():
    table = parse_dmon((DATA / "dmon_sample.log").read_text())
    assert table.gpus() == ["0", "1"]
    t, sm = table.series("0", "sm")
    assert t == [0.0, 5.0] and sm == [90.0, 94.0]  # across midnight, from the date column
    _, rx = table.series("1", "rxpci")
    assert math.isnan(rx[0]) and rx[1] == 900.0


def test_top_filter_keeps_summary_and_the_busiest_processes():
    source = io.BytesIO((DATA / "top_sample.log").read_bytes())
    sink = io.BytesIO()
    keep_top_lines(source, sink, limit=3)
    out = sink.getvalue().decode()
    assert out.count("top - ") == 3 and out.count("%Cpu(s)") == 3
    assert len(out.splitlines()) == 3 * (7 + 3)  # summary, blank, column header + 3 processes each
    assert parse_top(out).cpu_busy == parse_top((DATA / "top_sample.log").read_text()).cpu_busy


def test_monitor_commands():
    cmds = monitor_commands(5, gpus=True, user="alice")
    assert cmds["top"][:5] == ["top", "-b", "-d", "5", "-u"]
    assert cmds["dmon"] == ["nvidia-smi", "dmon", "-s", "pucvmet", "-o", "DT", "-d", "5"]
    assert "dmon" not in monitor_commands(5, gpus=False, user="alice")


def test_parsable_tables():
    rows = parse_parsable("JobID|MaxRSS\n7.batch|100K\n7.0|2G\n")
    assert rows == [{"JobID": "7.batch", "MaxRSS": "100K"}, {"JobID": "7.0", "MaxRSS": "2G"}]
    assert parse_parsable("Slurm accounting storage is disabled\n") == []


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "monitor").mkdir(parents=True)
    shutil.copy(DATA / "top_sample.log", run / "monitor" / "top_node1.log")
    shutil.copy(DATA / "dmon_sample.log", run / "monitor" / "dmon_node1.log")
    (run / "monitor" / "sstat_7.txt").write_text("JobID|MaxRSS\n7.0|2G\n")
    records = [{"step": s, "split": "train", "loss": 2.0 / s, "lr": 1e-3, "samples_per_s": 100.0 + s, "time": s}
               for s in (10, 20, 30)]
    records.append({"step": 30, "split": "val", "loss": 0.5, "accuracy": 0.9, "iou/skin": 0.75, "iou/hair": 0.5,
                    "time": 31})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_report_writes_pictures_and_a_summary_with_the_right_numbers(tmp_path, capsys):
    run = _run_dir(tmp_path)
    assert main(["report", str(run)]) == 0
    for name in ("overview.png", "gpu.png"):
        assert (run / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (run / "report" / "summary.md").read_text()
    assert summary == capsys.readouterr().out
    assert "accuracy 0.9" in summary and "120 samples/s" in summary
    assert "skin" not in summary.split("final validation:")[1].split("\n")[0]  # per-class values: a table
    assert "## Final validation: iou\n\n| | iou |\n|---|---:|\n| skin | 0.75 |\n| hair | 0.5 |\n" in summary
    assert "node1 gpu0 92%" in summary and "node1 gpu1 25%" in summary  # means of 90,94 and 30,20
    assert "| 7.0 | 2G |" in summary
    assert "GPU utilisation below 60% on node1 gpu1" in summary
    assert '<img src="gpu.png"' in (run / "report" / "index.html").read_text()


def test_observations_blame_the_data_pipeline_when_cpus_are_busy(tmp_path):
    facts = summary_facts(load_run(_run_dir(tmp_path)))
    facts["cpu_busy_mean"] = {"node1": 97.0}
    text = " ".join(observations(facts))
    assert "data pipeline is the likely limit" in text and "CPU busy above 95%" in text


def test_report_of_an_empty_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nothing to report" in err and "HINT:" in err
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_node_monitors_record_top_and_stop_with_the_context(tmp_path, monkeypatch):
    import time

    from hpctrain.monitor.sidecars import node_monitors

    monkeypatch.setenv("HPCTRAIN_MONITOR_DIR", str(tmp_path))
    monkeypatch.setenv("HPCTRAIN_MONITOR_EVERY", "1")
    with node_monitors() as paths:
        deadline = time.monotonic() + 20
        while not (paths and "%Cpu(s)" in paths[0].read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert paths and paths[0].name.startswith("top_") and "%Cpu(s)" in paths[0].read_text()
    size = paths[0].stat().st_size
    time.sleep(1.5)
    assert paths[0].stat().st_size == size  # top was stopped on exit


def test_no_monitors_unless_the_job_asks(monkeypatch):
    from hpctrain.monitor.sidecars import node_monitors

    monkeypatch.delenv("HPCTRAIN_MONITOR_DIR", raising=False)
    with node_monitors() as paths:
        assert paths == []


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[16:24]  # IHDR: width, height
    return int.from_bytes(header[:4], "big"), int.from_bytes(header[4:], "big")


def _local_run(tmp_path: Path, **extra) -> Path:
    """A run dir as a local CPU run leaves it: metrics.jsonl only, no node monitors."""
    run = tmp_path / "local"
    run.mkdir(parents=True)
    records = [{"step": s, "split": "train", "loss": 2.0 / s, "samples_per_s": 100.0, **extra} for s in (10, 20, 30)]
    records += [{"step": 30, "split": "val", "loss": 0.5, "accuracy": 0.9},
                {"step": 15, "split": "stop", "signal": "SIGTERM"},
                {"step": 15, "split": "resume", "checkpoint": "step_00000015", "world_size": 1, "saved_world_size": 2}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_a_cpu_runs_overview_has_no_empty_gpu_panel(tmp_path):
    """Without nvidia-smi logs or the log's gpu_busy, the GPU panel took a quarter of the figure, empty: three
    panels in a row instead. With gpu_busy, the fourth panel is back."""
    cpu = _local_run(tmp_path / "cpu")
    assert main(["report", str(cpu)]) == 0
    assert _png_size(cpu / "report" / "overview.png") == (1500, 450)
    gpu = _local_run(tmp_path / "gpu", gpu_busy=0.8)
    assert main(["report", str(gpu)]) == 0
    assert _png_size(gpu / "report" / "overview.png") == (1200, 750)


def test_the_summary_says_where_the_run_stopped_and_resumed(tmp_path, capsys):
    run = _local_run(tmp_path)
    assert main(["report", str(run)]) == 0
    assert ("- stops and resumes: stopped by SIGTERM at step 15; resumed at step 15 from checkpoint step_00000015 "
            "(saved by 2 process(es), resumed on 1)\n") in capsys.readouterr().out
