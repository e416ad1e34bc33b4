import json
from pathlib import Path

from hpctrain.metrics.plots import plot_training
from hpctrain.metrics.records import read_metrics, series
from hpctrain.metrics.sinks import build_metrics_logger, format_record
from hpctrain.resolution import resolve_config
from hpctrain.train.rundir import write_config


def log_config(run_dir: Path, progress: str, tensorboard: bool):
    """digits' config with these log settings in ``run_dir`` (what build_metrics_logger reads)."""
    return resolve_config("digits", None, [f"run.dir={run_dir}", f"log.progress={progress}",
                                           f"log.tensorboard={str(tensorboard).lower()}"])[1]


def test_logger_writes_jsonl_only_on_rank_0(tmp_path: Path):
    for rank_is_main, expect in ((False, False), (True, True)):
        logger = build_metrics_logger(log_config(tmp_path, "off", False), rank_is_main, 10, 0, tty=False)
        logger.log({"step": 1, "split": "train", "loss": 0.5})
        logger.close()
        assert (tmp_path / "metrics.jsonl").exists() is expect
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and record["split"] == "train" and record["loss"] == 0.5 and record["time"] > 0


def test_tensorboard_events_are_written(tmp_path: Path):
    logger = build_metrics_logger(log_config(tmp_path, "off", True), True, 10, 0, tty=False)
    logger.log({"step": 3, "split": "val", "accuracy": 0.9})
    logger.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_progress_bar_on_a_terminal(tmp_path: Path, capsys):
    logger = build_metrics_logger(log_config(tmp_path, "auto", False), True, 10, 0, tty=True)
    logger.log({"step": 4, "split": "train", "loss": 0.25, "samples_per_s": 100.0})
    logger.log({"step": 5, "split": "val", "accuracy": 0.75})
    logger.close()
    err = capsys.readouterr().err
    assert "4/10" in err and "loss=0.25" in err  # the bar
    assert "step 5/10 | val | accuracy 0.75" in err  # val lines printed above the bar


def test_a_resumed_run_keeps_the_last_record_per_step(tmp_path: Path):
    lines = [
        {"step": 1, "split": "train", "loss": 3.0},
        {"step": 2, "split": "train", "loss": 2.0},  # logged, then the job died before a checkpoint
        {"step": 2, "split": "train", "loss": 2.5},  # the resumed run's step 2
        {"step": 2, "split": "val", "accuracy": 0.5},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines) + '\n{"step": 3, "spl')  # torn last line
    records = read_metrics(path)
    assert series(records, "train", "loss") == ([1, 2], [3.0, 2.5])
    assert series(records, "val", "accuracy") == ([2], [0.5])


def test_plot_is_a_png(tmp_path: Path):
    records = [{"step": s, "split": "train", "loss": 1 / s, "lr": 0.1, "samples_per_s": 50.0} for s in range(1, 20)]
    records.append({"step": 19, "split": "val", "loss": 0.1, "accuracy": 0.9})
    out = plot_training(records, tmp_path / "plots" / "p.png", "title")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_format_record():
    line = format_record({"step": 5, "split": "train", "loss": 0.123456, "eta_s": 65.2, "time": 1.0}, 10)
    assert line == "step 5/10 | train | loss 0.1235 | eta 0:01:05"


def test_format_record_puts_detail_values_on_their_own_lines():
    record = {"step": 5, "split": "val", "miou": 0.5, "iou/skin": 0.9, "iou/hair": 0.8, "time": 1.0}
    assert format_record(record, 10).split("\n") == ["step 5/10 | val | miou 0.5", "    iou: hair 0.8 | skin 0.9"]


def test_changed_config_keeps_the_earlier_one(tmp_path: Path):
    write_config(tmp_path, "a = 1\n")
    write_config(tmp_path, "a = 1\n")
    assert [p.name for p in tmp_path.glob("config*.toml")] == ["config.toml"]
    write_config(tmp_path, "a = 2\n")
    kept = sorted(p.read_text() for p in tmp_path.glob("config*.toml"))
    assert kept == ["a = 1\n", "a = 2\n"] and (tmp_path / "config.toml").read_text() == "a = 2\n"


def test_log_lines_go_above_the_progress_bar(monkeypatch):
    """On a terminal a warning written while the bar is drawn was glued onto its end ('...samples_s=7490]16:07:32
    INFO ...'): log lines now clear the bar, go on a line of their own, and the bar is drawn again below."""
    import io
    import logging
    import re
    import sys

    from hpctrain.logs import setup_logging
    from hpctrain.metrics.sinks import ConsoleSink

    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    setup_logging()
    sink = ConsoleSink("bar", total_steps=10, start_step=0)
    try:
        sink.write({"split": "train", "step": 3, "loss": 0.5, "samples_per_s": 7490.0})
        logging.getLogger("hpctrain").warning("something to say")
        sink.write({"split": "train", "step": 4, "loss": 0.4, "samples_per_s": 7490.0})
    finally:
        sink.close()
        logging.getLogger().handlers.clear()
    text = terminal.getvalue()
    assert "something to say" in text
    assert not re.search(r"[^\r\n]\d\d:\d\d:\d\d WARNING something to say", text), repr(text)


def test_the_local_reports_fourth_panel_shows_validation_metrics():
    """A local run has no node monitors: the overview's CPU panel was empty and unlabelled while accuracy was nowhere."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hpctrain.monitor.report import plot_val_metrics

    records = [{"split": "val", "step": s, "loss": 1.0 / s, "accuracy": 0.5 + s / 100, "iou/x": 0.1} for s in (10, 20)]
    fig, ax = plt.subplots()
    plot_val_metrics(ax, records + [{"split": "train", "step": 5, "loss": 2.0}])
    assert ax.get_title() == "validation metrics" and [line.get_label() for line in ax.lines] == ["accuracy"]
    assert list(ax.lines[0].get_xdata()) == [10, 20]
    fig2, empty = plt.subplots()
    plot_val_metrics(empty, [])
    assert empty.get_title() == "validation metrics: none logged"
    plt.close(fig)
    plt.close(fig2)


def test_stop_and_resume_events_go_to_metrics_jsonl_only(tmp_path: Path, caplog):
    """The report reads them from metrics.jsonl; the console has the log's own lines, TensorBoard no use for them."""
    import logging

    logger = build_metrics_logger(log_config(tmp_path, "lines", False), True, 30, 15, tty=False)
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        logger.log({"step": 15, "split": "stop", "epoch": 0, "signal": "SIGTERM"})
        logger.log({"step": 15, "split": "resume", "epoch": 0, "checkpoint": "step_00000015", "world_size": 2,
                    "saved_world_size": 2})
        logger.log({"step": 20, "split": "train", "loss": 0.5})
    logger.close()
    assert [r["split"] for r in read_metrics(tmp_path / "metrics.jsonl")] == ["resume", "stop", "train"]
    assert "| resume |" not in caplog.text and "| stop |" not in caplog.text and "step 20/30 | train" in caplog.text


def test_the_plots_mark_each_resume():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hpctrain.metrics.plots import plot_loss

    records = [{"step": s, "split": "train", "loss": 1 / s} for s in (10, 20, 30)]
    records += [{"step": 15, "split": "resume"}, {"step": 24, "split": "resume"}]
    fig, ax = plt.subplots()
    plot_loss(ax, records)
    marks = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert [list(line.get_xdata()) for line in marks] == [[15, 15], [24, 24]]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["train loss", "resumed"]  # named once
    plt.close(fig)
