"""Where metric records go: metrics.jsonl, the console, TensorBoard, the experiment trackers (metrics/trackers).

A record is a flat dict: ``step`` (optimizer step), ``split`` ('train' or 'val'),
``time`` (Unix seconds) and numbers such as ``loss``, ``lr``, ``samples_per_s``,
``accuracy``. Only global rank 0 builds real sinks; other ranks get a logger
with none, so call sites need no rank checks.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

from hpctrain.errors import UserError
from hpctrain.metrics.images import write_png
from hpctrain.metrics.records import EVENTS, metric_values
from hpctrain.metrics.trackers.build import build_tracker_sinks

if TYPE_CHECKING:
    from hpctrain.config.schema import RunConfig

log = logging.getLogger("hpctrain")


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class ImageSink(Protocol):
    def write_image(self, tag: str, step: int, image: np.ndarray) -> Path | None: ...


class PngSink:
    """ROOT/TAG/step_NNNNNNN.png, one file per call. During training a picture that cannot be written (a full
    disk, a quota) is a warning, not the end of the run (strict=False); where the pictures are the point
    (`hpctrain sample`), it is an error that says where."""

    def __init__(self, root: Path, strict: bool = False) -> None:
        self.root = root
        self.strict = strict

    def write_image(self, tag: str, step: int, image: np.ndarray) -> Path | None:
        path = self.root / tag / f"step_{step:07d}.png"
        try:
            return write_png(path, image)
        except OSError as err:
            if self.strict:
                raise UserError(f"cannot write {path}: {err}", "free space there, or choose another --out.") from None
            log.warning("cannot write %s (%s); training goes on without this picture", path, err)
            return None


class JsonlSink:
    """One JSON object per line, flushed per line so a killed job keeps what it logged."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        try:
            self.file.write(json.dumps(record, sort_keys=True) + "\n")
            self.file.flush()
        except OSError as err:  # a full disk or quota: the user's to fix, said as such (exit 2), not a traceback
            raise UserError(f"cannot write {self.path}: {err}",
                            "free disk space or fix the file system, then resume: the last checkpoint is intact.") from None

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:  # what was left in the buffer failed to write; write() has said why
            pass


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        if record["split"] in EVENTS:
            return
        for key, value in metric_values(record).items():
            self.writer.add_scalar(f"{record['split']}/{key}", value, record["step"])

    def write_image(self, tag: str, step: int, image: np.ndarray) -> None:
        self.writer.add_image(tag, image, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def format_record(record: dict[str, Any], total_steps: int) -> str:
    """One line of the top-level values; then one indented line per group of detail values ('iou/skin',
    'iou/hair', ...: keys with a '/'), so 19 per-class numbers do not bury the headline ones."""
    parts = [f"step {record['step']}/{total_steps}", record["split"]]
    groups: dict[str, list[str]] = {}
    for key in sorted(k for k in record if k not in ("step", "split", "time", "eta_s")):
        value = record[key]
        text = f"{value:.4g}" if isinstance(value, float) else f"{value}"
        group, slash, name = key.partition("/")
        if slash:
            groups.setdefault(group, []).append(f"{name} {text}")
        else:
            parts.append(f"{key} {text}")
    if "eta_s" in record:
        parts.append(f"eta {datetime.timedelta(seconds=round(record['eta_s']))}")
    lines = [" | ".join(parts)]
    lines += [f"    {group}: " + " | ".join(items) for group, items in groups.items()]
    return "\n".join(lines)


class ConsoleSink:
    """A tqdm bar on a terminal; plain lines otherwise (a Slurm log file is not a terminal,
    and a bar's carriage returns make it unreadable)."""

    def __init__(self, mode: str, total_steps: int, start_step: int) -> None:
        self.total = total_steps
        self.bar = None
        self._redirected: list[tuple[logging.StreamHandler, Any]] = []
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
            # Log lines (warnings, checkpoints) go above the bar: written as they are, they were glued onto its end
            # ("...samples_s=7490]16:07:32 INFO ...").
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr:
                    self._redirected.append((handler, handler.setStream(_AboveBars(sys.stderr))))

    def write(self, record: dict[str, Any]) -> None:
        if record["split"] in EVENTS:  # the log says it in words
            return
        if self.bar is not None and record["split"] == "train":
            self.bar.n = record["step"]
            self.bar.set_postfix(loss=f"{record['loss']:.4g}", samples_s=f"{record.get('samples_per_s', 0):.0f}")
            return
        line = format_record(record, self.total)
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)  # the bar's stream, or the two interleave
        else:
            log.info(line)

    def close(self) -> None:
        for handler, stream in self._redirected:
            handler.setStream(stream)
        self._redirected.clear()
        if self.bar is not None:
            self.bar.close()


class _AboveBars:
    """A stream whose writes clear tqdm's bars first and redraw them after (tqdm.external_write_mode)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        from tqdm import tqdm

        with tqdm.external_write_mode(file=self.stream):
            return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


class MetricsLogger:
    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def log(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        for sink in self.sinks:
            if hasattr(sink, "write"):
                sink.write(record)

    def image(self, tag: str, step: int, image: np.ndarray) -> Path | None:
        """An H x W x C uint8 picture to every sink that takes images; the PNG's path (None: no PNG sink)."""
        path = None
        for sink in self.sinks:
            if hasattr(sink, "write_image"):
                path = sink.write_image(tag, step, image) or path
        return path

    def close(self) -> None:
        for sink in self.sinks:
            if hasattr(sink, "close"):
                sink.close()


def build_metrics_logger(
    cfg: "RunConfig", is_main: bool, total_steps: int, start_step: int, tty: bool,
    durable_step: Callable[[], int] | None = None,
) -> MetricsLogger:
    """Rank 0's sinks for a training of ``cfg`` that starts at ``start_step`` (after the restore): metrics.jsonl,
    PNGs, the console, TensorBoard, the trackers of log.trackers. ``durable_step``: the newest committed checkpoint's
    step (Checkpointer.committed_step), up to which the trackers may send (metrics/trackers/sink.py); None for a
    training that cannot resume from a checkpoint: they send at once. The other ranks get a logger with no sinks."""
    if not is_main:
        return MetricsLogger([])
    run_dir, c = Path(cfg.run_dir), cfg.log
    sinks: list[Any] = [JsonlSink(run_dir / "metrics.jsonl"), PngSink(run_dir / "images")]
    if c.progress != "off":
        mode = c.progress if c.progress != "auto" else ("bar" if tty else "lines")
        sinks.append(ConsoleSink(mode, total_steps, start_step))
    if c.tensorboard or "tensorboard" in c.trackers:
        try:
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        except ImportError:
            log.info("tensorboard is not installed; skipping TensorBoard event files (pip install tensorboard)")
    sinks += build_tracker_sinks(cfg, start_step, total_steps, durable_step)
    return MetricsLogger(sinks)
