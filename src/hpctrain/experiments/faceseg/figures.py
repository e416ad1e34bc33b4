"""Pictures of face parsing: coloured label maps, the side-by-side comparison with a legend, and the curves.

Colours are CelebAMask-HQ's own (the release's ``g_color.py``), so pictures read like the data set's."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from hpctrain.datasets.sources.celebamask import CLASSES

PALETTE = np.array([
    [0, 0, 0], [204, 0, 0], [76, 153, 0], [204, 204, 0], [51, 51, 255], [204, 0, 204], [0, 255, 255],
    [255, 204, 204], [102, 51, 0], [255, 0, 0], [102, 204, 0], [255, 255, 0], [0, 0, 153], [0, 0, 204],
    [255, 51, 153], [0, 204, 204], [0, 51, 0], [255, 153, 51], [0, 204, 0],
], dtype=np.uint8)
"""RGB per class, in CLASSES order (background black)."""


def colorize(labels: torch.Tensor | np.ndarray) -> np.ndarray:
    """H x W class indices -> H x W x 3 uint8 (indices outside the palette, e.g. 255 = ignore, are white)."""
    labels = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels).astype(np.int64)
    table = np.vstack([PALETTE, np.full((256 - len(PALETTE), 3), 255, np.uint8)])
    return table[np.clip(labels, 0, 255)]


def comparison_figure(images: Sequence[np.ndarray], columns: Sequence[tuple[str, Sequence[Any]]],
                      class_names: Sequence[str] = CLASSES, title: str = "") -> np.ndarray:
    """One row per image: the image, then one coloured label map per column (``(title, maps)``, e.g. ground
    truth, this run's prediction, another run's), and a legend of the classes' colours. H x W x 3 uint8."""
    plt = _pyplot()
    rows, cols = len(images), 1 + len(columns)
    ncol = min(len(class_names), 2 * cols)  # legend entries per line: what the figure's width holds
    legend_in = 0.2 * -(-len(class_names) // ncol) + 0.15  # inches for the legend's lines
    height = 2.3 * rows + legend_in
    fig, axes = plt.subplots(rows, cols, figsize=(2.3 * cols, height), squeeze=False)
    for r, image in enumerate(images):
        axes[r, 0].imshow(image)
        for c, (_, maps) in enumerate(columns, start=1):
            axes[r, c].imshow(colorize(maps[r]))
    for c, name in enumerate(["image", *[t for t, _ in columns]]):
        axes[0, c].set_title(name, fontsize=9)
    for ax in axes.flat:
        ax.set_axis_off()
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=PALETTE[i] / 255, edgecolor="grey", label=n) for i, n in enumerate(class_names)]
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=7, frameon=False, handlelength=1.2,
               columnspacing=0.8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, legend_in / height, 1, 1))
    return _to_array(fig)


def curves_figure(records: Sequence[dict[str, Any]], title: str = "") -> np.ndarray:
    """Loss (train and validation), mIoU and pixel accuracy / mean F1 over optimizer steps. H x W x 3 uint8."""
    from hpctrain.metrics.plots import plot_loss
    from hpctrain.metrics.records import series

    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    plot_loss(axes[0], list(records))
    for ax, keys, name in ((axes[1], ("miou", "miou_fg"), "mIoU (validation)"),
                           (axes[2], ("pixel_acc", "mean_f1"), "pixel accuracy, mean F1 (validation)")):
        for key in keys:
            x, y = series(list(records), "val", key)
            if x:
                ax.plot(x, [100 * v for v in y], "o-", markersize=3, label=key)
                ax.annotate(f"{100 * y[-1]:.2f}", (x[-1], 100 * y[-1]), textcoords="offset points", xytext=(-12, 6))
        ax.set(title=name, xlabel="optimizer step", ylabel="%")
        if ax.lines:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _to_array(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _to_array(fig) -> np.ndarray:
    plt = _pyplot()
    fig.canvas.draw()
    array = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return array
