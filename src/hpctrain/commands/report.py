"""`hpctrain report DIR`: a run dir's plots and summary (monitor/report.py), or a sweep dir's comparison of its
points (sweep/report.py); the summary is printed, the files written under DIR/report."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    report = sub.add_parser("report", help="plots and a summary (Markdown + HTML) of a run dir's metrics and monitors, "
                            "or a sweep dir's comparison of its points")
    report.add_argument("run_dir", help="the run directory, or a sweep directory")
    report.add_argument("--debug", action="store_true", help="show tracebacks")
    report.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hpctrain.sweep.spec import SWEEP_FILE

    if (Path(args.run_dir) / SWEEP_FILE).is_file():  # a sweep dir: the comparison of its points
        from hpctrain.sweep.report import write_sweep_report

        out, files = write_sweep_report(Path(args.run_dir)), "curves*.png"
    else:
        from hpctrain.monitor.report import write_report

        out, files = write_report(Path(args.run_dir)), "*.png"
    print((out / "summary.md").read_text(), end="")
    print(f"hpctrain: report written to {out}/ (index.html, summary.md, {files})", file=sys.stderr)
    return 0
