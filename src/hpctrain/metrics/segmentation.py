"""Exact segmentation metrics from one confusion matrix.

Every rank counts a C x C confusion matrix (rows: ground truth, columns: prediction) over its validation
pixels; hpctrain sums the matrices over batches and ranks (one all-reduce of float64, exact up to 2^53 pixels),
and every metric comes from the summed matrix. Averaging per-rank or per-batch IoUs instead gives a different,
world-size-dependent number: an IoU is a ratio, and a mean of ratios is not the ratio of the sums.

The conventions (miou with and without background, classes with no IoU, pixel accuracy, mean F1, the ignored
label) are those of the usual CelebAMask-HQ evaluation (face-parsing.PyTorch, FaRL, SegFace); segmentation_metrics
states them.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def confusion_matrix(pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_index: int = 255) -> torch.Tensor:
    """C x C int64 counts, rows = target class, columns = predicted class, on the inputs' device.

    Without a device synchronisation: ignored pixels go to an extra bin that is cut off (boolean indexing or
    bincount would size their output from the data, which waits for the GPU)."""
    if pred.shape != target.shape:
        raise ValueError(f"prediction {tuple(pred.shape)} and target {tuple(target.shape)} differ in shape")
    target = target.long()
    pred = pred.long()
    valid = (target >= 0) & (target < num_classes) & (target != ignore_index)
    flat = torch.where(valid, target * num_classes + pred.clamp(0, num_classes - 1), num_classes * num_classes)
    counts = torch.zeros(num_classes * num_classes + 1, dtype=torch.int64, device=pred.device)
    counts.index_add_(0, flat.reshape(-1), torch.ones_like(flat.reshape(-1)))
    return counts[:-1].view(num_classes, num_classes)


def per_class(cm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(IoU, F1) per class as float64 tensors, NaN where a class is neither in the target nor predicted."""
    cm = cm.double()
    tp = cm.diagonal()
    fp = cm.sum(0) - tp
    fn = cm.sum(1) - tp
    union = tp + fp + fn
    nan = torch.full_like(tp, math.nan)
    iou = torch.where(union > 0, tp / union.clamp(min=1), nan)
    f1 = torch.where(union > 0, 2 * tp / (2 * tp + fp + fn).clamp(min=1), nan)
    return iou, f1


def segmentation_metrics(cm: torch.Tensor, class_names: Sequence[str], background: int = 0) -> dict[str, float]:
    """miou, miou_fg, pixel_acc, mean_f1, mean_f1_bg and iou/<class> from a summed confusion matrix.

    ``miou``: the mean over all classes, background included, of TP / (TP + FP + FN), pixels counted over the whole
    validation set (not per image). ``miou_fg`` leaves background out. A class that is absent from the ground truth
    *and* never predicted has no IoU (0/0): it is left out of the mean (and has no iou/<class> entry). A class
    absent from the ground truth but predicted somewhere has IoU 0. ``pixel_acc``: correctly labelled pixels /
    labelled pixels. ``mean_f1``: the mean over foreground classes of the per-class F1 (Dice) = 2TP / (2TP + FP +
    FN), pooled over the set, as FaRL and SegFace report it on CelebAMask-HQ; ``mean_f1_bg`` includes background.
    Pixels whose label is ``ignore_index`` count nowhere. (These are the conventions of face-parsing.PyTorch and the
    blog's run.)"""
    if cm.shape != (len(class_names), len(class_names)):
        raise ValueError(f"confusion matrix {tuple(cm.shape)} for {len(class_names)} classes")
    iou, f1 = per_class(cm)
    fg = torch.ones(len(class_names), dtype=torch.bool)
    fg[background] = False
    total = float(cm.double().sum())
    out = {
        "miou": _nanmean(iou),
        "miou_fg": _nanmean(iou[fg]),
        "pixel_acc": float(cm.double().diagonal().sum()) / total if total else math.nan,
        "mean_f1": _nanmean(f1[fg]),
        "mean_f1_bg": _nanmean(f1),
    }
    # A class without an IoU is left out (JSON has no NaN); iou_table shows it as n/a.
    out.update({f"iou/{name}": float(v) for name, v in zip(class_names, iou) if not math.isnan(float(v))})
    return out


def _nanmean(values: torch.Tensor) -> float:
    present = values[~values.isnan()]
    return float(present.mean()) if present.numel() else math.nan


def iou_table(metrics: dict[str, float], class_names: Sequence[str]) -> str:
    """A plain-text table of per-class IoU (for the log and the report), classes as rows."""
    width = max(len(n) for n in class_names)
    lines = [f"{'class':<{width}}  IoU %"]
    for name in class_names:
        value = metrics.get(f"iou/{name}", math.nan)
        lines.append(f"{name:<{width}}  {'   n/a' if math.isnan(value) else f'{100 * value:6.2f}'}")
    lines.append(f"{'mean':<{width}}  {100 * metrics['miou']:6.2f}")
    return "\n".join(lines)
