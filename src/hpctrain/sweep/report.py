"""`hpctrain report SWEEP_DIR`: every point's final and best validation metrics in one table (ranked by the
experiment's main metric, the best marked, failed points listed with their error), and the points' validation
curves overlaid (and, with two or more axes, one panel per value of the first), as SWEEP_DIR/report/summary.md and
index.html with curves.png and curves_by_AXIS.png."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hpctrain.config.target import is_script
from hpctrain.monitor.report import summary_html
from hpctrain.sweep.metric import MetricSource, metric_source
from hpctrain.sweep.status import PointStatus, collect_status, point_curve, point_error
from hpctrain.sweep.spec import SweepSpec, read_plan


@dataclass(frozen=True)
class PointResult:
    name: str
    settings: tuple[tuple[str, str], ...]
    state: str
    steps: int | None
    final: float | None
    """The main metric at the last validation."""
    best: float | None
    best_step: int | None
    error: str = ""
    curve: tuple[tuple[int, float], ...] = ()
    """(step, main metric) of every validation."""


def point_results(plan: SweepSpec, main: str, higher: bool, statuses: list[PointStatus],
                  source: MetricSource | None = None) -> list[PointResult]:
    """Each point's curve of the ``main`` metric, its final and best value; ``source``: where the metric comes from
    (default: validation records of ``main``)."""
    source = source or MetricSource(name=main, higher_is_better=higher)
    out = []
    for point, status in zip(plan.points, statuses, strict=True):
        curve = tuple(point_curve(plan, point, source))
        best = (max if source.higher_is_better else min)(curve, key=lambda sv: sv[1]) if curve else None
        error = point_error(plan, point.name) if status.state == "failed" else ""
        out.append(PointResult(point.name, point.settings, status.state, status.step,
                               curve[-1][1] if curve else None, best[1] if best else None,
                               best[0] if best else None, error, curve))
    return out


def ranked(results: list[PointResult], higher: bool) -> list[PointResult]:
    """Finished points by their final metric, best first; then points with a metric that have not finished (running,
    failed after a validation); then the others in their order (failed ones are not dropped)."""
    def scored(r: PointResult) -> bool:
        return r.final is not None and not math.isnan(r.final)

    key = lambda r: -r.final if higher else r.final  # type: ignore[operator]  # noqa: E731
    done = sorted((r for r in results if scored(r) and r.state == "done"), key=key)
    partial = sorted((r for r in results if scored(r) and r.state != "done"), key=key)
    return done + partial + [r for r in results if not scored(r)]


def sweep_table(plan: SweepSpec, results: list[PointResult], main: str, higher: bool) -> str:
    """The comparison as Markdown (a pure function of its inputs: golden-tested)."""
    keys = [a.key for a in plan.axes]
    goal = "higher is better" if higher else "lower is better"
    what = "final" if is_script(plan.experiment) else "final validation"
    lines = [f"# Sweep report: {plan.sweep_dir.name}", "",
             f"Sweep dir: `{plan.sweep_dir}`; experiment {plan.experiment}; {len(results)} point(s); "
             f"ranked by the {what} {main} ({goal}).", "",
             "| rank | point | " + " | ".join(keys) + f" | final {main} | best {main} (step) | steps | state |",
             "|---:|---|" + "---|" * len(keys) + "---:|---:|---:|---|"]
    order = ranked(results, higher)
    for rank, r in enumerate(order, 1):
        has = r.final is not None
        mark = " **best**" if rank == 1 and has and r.state == "done" else ""
        final = f"{r.final:.4g}{mark}" if has else "-"
        best = f"{r.best:.4g} ({r.best_step})" if r.best is not None else "-"
        values = " | ".join(v for _, v in r.settings)
        lines.append(f"| {rank if has else '-'} | {r.name} | {values} | {final} | {best} | "
                     f"{'-' if r.steps is None else r.steps} | {r.state} |")
    failed = [r for r in order if r.state == "failed"]
    if failed:
        lines += ["", "## Failed points", ""] + [f"- {r.name}: {r.error or 'no error line found'}" for r in failed]
    return "\n".join(lines) + "\n"


def plot_curves(plan: SweepSpec, results: list[PointResult], main: str, out: Path, by_first: bool = False) -> Path:
    """The points' validation curves overlaid in one panel; by_first: one panel per value of the first axis (the
    other axes in each), which reads better when the points are many."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = plan.axes[0]
    panels: list[str | None] = list(first.values) if by_first else [None]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels) if by_first else 7, 4), squeeze=False,
                             sharey=True)
    for ax, value in zip(axes[0], panels):
        for r in results:
            if not r.curve or (value is not None and dict(r.settings)[first.key] != value):
                continue
            label = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in r.settings if value is None or k != first.key)
            ax.plot([s for s, _ in r.curve], [m for _, m in r.curve], marker="o", markersize=3, label=label)
        kind = "" if is_script(plan.experiment) else "validation "
        ax.set_title(f"{first.key}={value}" if value is not None else f"{kind}{main}, every point")
        ax.set_xlabel("step")
        ax.set_ylabel(main)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_sweep_report(sweep_dir: Path) -> Path:
    plan = read_plan(sweep_dir)
    source = metric_source(plan)
    main, higher = source.name, source.higher_is_better
    results = point_results(plan, main, higher, collect_status(plan), source)
    out = plan.sweep_dir / "report"
    out.mkdir(exist_ok=True)
    pictures = [plot_curves(plan, results, main, out / "curves.png").name]
    if len(plan.axes) > 1:
        by = plan.axes[0].key.rsplit(".", 1)[-1]
        pictures.append(plot_curves(plan, results, main, out / f"curves_by_{by}.png", by_first=True).name)
    markdown = sweep_table(plan, results, main, higher) + "\n" + "".join(f"![{p}]({p})\n" for p in pictures)
    (out / "summary.md").write_text(markdown)
    (out / "index.html").write_text(summary_html(markdown, pictures))
    return out
