"""Segmentation metrics from a confusion matrix: conventions checked against direct counting."""

import math

import numpy as np
import pytest
import torch

from hpctrain.metrics.segmentation import confusion_matrix, iou_table, per_class, segmentation_metrics


def _direct_iou(pred, target, c, ignore=255):
    valid = target != ignore
    p, t = (pred == c) & valid, (target == c) & valid
    union = (p | t).sum()
    return math.nan if union == 0 else float((p & t).sum() / union)


def test_confusion_matrix_counts_pixels_and_skips_ignored():
    target = torch.tensor([[0, 1, 1], [2, 255, 2]])
    pred = torch.tensor([[0, 1, 2], [2, 0, 1]])
    cm = confusion_matrix(pred, target, 3)
    expected = torch.tensor([[1, 0, 0], [0, 1, 1], [0, 1, 1]])
    assert cm.dtype == torch.int64
    assert torch.equal(cm, expected)
    assert int(cm.sum()) == 5  # the ignored pixel counts nowhere


def test_per_class_iou_and_f1_match_direct_counting():
    rng = np.random.default_rng(0)
    target = torch.from_numpy(rng.integers(0, 5, (4, 16, 16)))
    target[0, :3] = 255
    pred = torch.from_numpy(rng.integers(0, 5, (4, 16, 16)))
    pred[target == 3] = 3  # a class predicted perfectly
    target[target == 4] = 0  # class 4: predicted, never in the ground truth -> IoU 0
    iou, f1 = per_class(confusion_matrix(pred, target, 6))
    for c in range(5):
        assert iou[c].item() == pytest.approx(_direct_iou(pred, target, c))
        assert f1[c].item() == pytest.approx(2 * iou[c].item() / (1 + iou[c].item()))  # F1 = 2 IoU / (1 + IoU)
    assert iou[4].item() == 0.0
    assert math.isnan(iou[5].item())  # neither present nor predicted: no IoU


def test_metrics_conventions():
    # 3 classes; class 2 neither present nor predicted.
    cm = torch.tensor([[6, 2, 0], [1, 3, 0], [0, 0, 0]])
    m = segmentation_metrics(cm, ["background", "a", "b"])
    iou_bg, iou_a = 6 / 9, 3 / 6
    assert m["miou"] == pytest.approx((iou_bg + iou_a) / 2)  # the absent class is left out of the mean
    assert m["miou_fg"] == pytest.approx(iou_a)
    assert m["pixel_acc"] == pytest.approx(9 / 12)
    assert m["mean_f1"] == pytest.approx(2 * 3 / (6 + 2 + 1))
    assert m["mean_f1_bg"] == pytest.approx((2 * 6 / (12 + 1 + 2) + 2 * 3 / 9) / 2)
    assert "iou/b" not in m and m["iou/a"] == pytest.approx(iou_a)
    table = iou_table(m, ["background", "a", "b"])
    assert "n/a" in table.splitlines()[3] and "50.00" in table


def test_pooled_over_the_set_not_averaged_per_batch():
    """The mean of per-batch mIoUs is not the set's mIoU; summed matrices give the set's."""
    rng = np.random.default_rng(1)
    batches = [(torch.from_numpy(rng.integers(0, 3, (2, 8, 8))), torch.from_numpy(rng.integers(0, 3, (2, 8, 8))))
               for _ in range(5)]
    summed = sum(confusion_matrix(p, t, 3) for p, t in batches)
    whole = confusion_matrix(torch.cat([p for p, _ in batches]), torch.cat([t for _, t in batches]), 3)
    assert torch.equal(summed, whole)
    per_batch = np.mean([segmentation_metrics(confusion_matrix(p, t, 3), "xyz")["miou"] for p, t in batches])
    assert segmentation_metrics(summed, "xyz")["miou"] != pytest.approx(per_batch, abs=1e-9)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="differ in shape"):
        confusion_matrix(torch.zeros(2, 3), torch.zeros(3, 2), 3)
