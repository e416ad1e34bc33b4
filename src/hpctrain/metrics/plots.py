"""PNG plots of a run's curves (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpctrain.metrics.records import events, series

_SKIP = {"step", "split", "time", "epoch", "loss", "lr", "samples_per_s", "eta_s", "grad_norm"}


def plot_loss(ax, records: list[dict[str, Any]]) -> None:
    """Train and validation loss on a log axis (the loss panel of every figure that shows one)."""
    for split, style in (("train", "-"), ("val", "o-")):
        x, y = series(records, split, "loss")
        if x:
            ax.plot(x, y, style, label=f"{split} loss", markersize=3)
    mark_resumes(ax, records, label=True)
    ax.set(title="loss (mean over all ranks)", xlabel="optimizer step")
    if ax.lines:
        ax.set_yscale("log")
        ax.legend()


def mark_resumes(ax, records: list[dict[str, Any]], label: bool = False) -> None:
    """A dashed vertical line at each step the run was resumed from a checkpoint (after a stop, a crash or the end
    of a launch), on a panel whose x axis is the optimizer step; ``label``: name it in the panel's legend."""
    for i, record in enumerate(events(records, "resume")):
        ax.axvline(record["step"], color="grey", linestyle="--", linewidth=0.8,
                   label="resumed" if label and i == 0 else None)


def plot_training(records: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    """One figure with loss, validation metrics, learning rate and throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    plot_loss(axes[0, 0], records)
    ax = axes[0, 1]
    # Detail values ('iou/skin': keys with a '/') would bury the headline curves; the experiment plots its own.
    val_keys = sorted({k for r in records if r["split"] == "val" for k in r if k not in _SKIP and "/" not in k})
    for key in val_keys:
        x, y = series(records, "val", key)
        ax.plot(x, y, "o-", label=key, markersize=3)
        if y:
            ax.annotate(f"{y[-1]:.4g}", (x[-1], y[-1]), textcoords="offset points", xytext=(-10, 6))
    mark_resumes(ax, records)
    ax.set(title="validation metrics", xlabel="optimizer step")
    if val_keys:
        ax.legend()
    for ax, key, label in ((axes[1, 0], "lr", "learning rate"), (axes[1, 1], "samples_per_s", "samples/s (all ranks)")):
        x, y = series(records, "train", key)
        ax.plot(x, y, "-")
        mark_resumes(ax, records)
        ax.set(title=label, xlabel="optimizer step")
    if title:
        fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
