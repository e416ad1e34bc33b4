"""The real layouts (CIFAR-10 python batches, CelebAMask-HQ, ImageFolder) on fixtures in those formats,
through `hpctrain shard`."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hpctrain.cli import main
from hpctrain.datasets import fixtures
from hpctrain.data.paired import paired_crop_flip
from hpctrain.data.shardset import ShardDataset
from hpctrain.datasets.sources import celebamask, cifar10
from hpctrain.errors import UserError


def shard(*args: str) -> int:
    return main(["shard", *args])


def leftovers(out: Path) -> list[str]:
    """Everything in OUT. A split is written into OUT/.SPLIT.partial and renamed into place when complete, so a
    failure in the first split must leave OUT empty: no SPLIT, no .SPLIT.partial, no .SPLIT.old."""
    return sorted(p.name for p in out.iterdir())


def test_cifar10_shards_hold_the_exact_pixels_and_labels(tmp_path: Path):
    fixtures.make_cifar10(tmp_path / "src", per_batch=6, test=5)
    assert shard(str(tmp_path / "src"), str(tmp_path / "out"), "--format", "cifar10", "--shard-size", "20KB") == 0
    train = ShardDataset(tmp_path / "out" / "train", ["png", "cls", "json"], num_classes=10)
    assert len(train) == 30 and len(ShardDataset(tmp_path / "out" / "test", ["png"])) == 5
    with open(tmp_path / "src" / cifar10.FOLDER / "data_batch_2", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    image, label, meta = train[6 + 4]  # batch 2, row 4
    expected = np.asarray(raw[b"data"][4], dtype=np.uint8).reshape(3, 32, 32)
    assert torch.equal(image, torch.from_numpy(expected)) and label == raw[b"labels"][4]
    assert meta == {"batch": "data_batch_2", "row": 4, "filename": "fixture_1_4.png"}
    manifest = json.loads((tmp_path / "out" / "train" / "manifest.json").read_text())
    assert manifest["dataset"] == "cifar10" and manifest["classes"][0] == "airplane"


def test_cifar10_missing_or_offline_or_corrupt(tmp_path: Path, monkeypatch, capsys):
    assert shard(str(tmp_path), str(tmp_path / "out"), "--format", "cifar10") == 2
    assert "add --download" in capsys.readouterr().err

    def offline(*_a, **_k):
        raise OSError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr("torchvision.datasets.utils.download_and_extract_archive", offline)
    assert shard(str(tmp_path), str(tmp_path / "out"), "--format", "cifar10", "--download") == 2
    err = capsys.readouterr().err
    assert "cannot download CIFAR-10" in err and "on a machine with internet access" in err
    fixtures.make_cifar10(tmp_path / "src", per_batch=2, test=2)
    (tmp_path / "src" / cifar10.FOLDER / "data_batch_3").write_bytes(b"not a pickle")
    assert shard(str(tmp_path / "src"), str(tmp_path / "out"), "--format", "cifar10") == 2
    assert "data_batch_3 is not a CIFAR-10 python batch" in capsys.readouterr().err
    assert leftovers(tmp_path / "out") == [], "a failed split leaves nothing behind"


def test_celebamask_label_maps_follow_the_release_overlap_order(tmp_path: Path):
    fixtures.make_celebamask(tmp_path, count=3, size=64, mask_size=32)
    labels = celebamask.label_map(tmp_path, 1)
    masks = {p: np.asarray(Image.open(tmp_path / celebamask.MASKS / "0" / f"00001_{p}.png")) > 127
             for p in ("skin", "hair", "eye_g", "l_eye")}
    assert labels.shape == (32, 32) and labels.dtype == np.uint8
    assert (labels[masks["hair"]] == celebamask.CLASSES.index("hair")).all(), "hair is painted after skin"
    # eye_g (3) comes before l_eye (4): the eye covers the glasses where both are drawn.
    assert (labels[masks["l_eye"]] == 4).all() and (labels[masks["eye_g"] & ~masks["l_eye"] & ~masks["hair"]] == 3).any()
    assert celebamask.label_map(tmp_path, 1, size=(64, 64)).shape == (64, 64)


def test_celebamask_shards_splits_and_missing_masks(tmp_path: Path, capsys):
    src = fixtures.make_celebamask(tmp_path / "src", count=20, size=48, mask_size=24)
    assert shard(str(src), str(tmp_path / "out"), "--format", "celebamask", "--resize", "32", "--shard-size", "50KB") == 0
    train, val = (ShardDataset(tmp_path / "out" / s, ["jpg", "png", "json"]) for s in ("train", "val"))
    assert (len(train), len(val)) == (18, 2), "no split files: the seeded 90/10 split"
    image, labels, meta = train[0]
    assert image.shape == (3, 32, 32) and labels.shape == (1, 32, 32) and int(labels.max()) < 19
    assert meta["split"] == "train"
    # The standard split when CelebA's partition files are present.
    src2 = fixtures.make_celebamask(tmp_path / "src2", count=20, size=48, mask_size=24, standard_split=True)
    assert shard(str(src2), str(tmp_path / "out2"), "--format", "celebamask") == 0
    assert {s: len(ShardDataset(tmp_path / "out2" / s, ["jpg"])) for s in ("train", "val", "test")} == \
        {"train": 16, "val": 2, "test": 2}
    # An image without any mask part: an error naming it, or a counted skip.
    for p in (src2 / celebamask.MASKS / "0").glob("00007_*.png"):
        p.unlink()
    assert shard(str(src2), str(tmp_path / "out3"), "--format", "celebamask") == 2
    assert "image 7 has no mask parts" in capsys.readouterr().err
    assert shard(str(src2), str(tmp_path / "out3"), "--format", "celebamask", "--on-error", "skip") == 0
    manifest = json.loads((tmp_path / "out3" / "train" / "manifest.json").read_text())
    assert manifest["samples"] == 15 and manifest["skipped"][0].startswith("image 7: ")


def test_imagefolder_corrupt_file_and_existing_output(tmp_path: Path, capsys):
    src = fixtures.make_imagefolder(tmp_path / "src", classes=2, per_class=4, splits=("train", "val"))
    (src / "train" / "class_1" / "img_00002.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    assert shard(str(src), str(tmp_path / "out"), "--format", "imagefolder") == 2
    err = capsys.readouterr().err
    assert "cannot read image" in err and "img_00002.jpg" in err, "the error names the file"
    assert leftovers(tmp_path / "out") == [], "the failed train split (the first) leaves nothing behind"
    assert shard(str(src), str(tmp_path / "out"), "--format", "imagefolder", "--on-error", "skip") == 0
    ds = ShardDataset(tmp_path / "out" / "train", ["jpg", "cls", "json"], num_classes=2)
    assert len(ds) == 7 and ds[0][2]["class"] == "class_0"
    before = (tmp_path / "out" / "train" / "manifest.json").read_text()
    assert shard(str(src), str(tmp_path / "out"), "--format", "imagefolder", "--on-error", "skip") == 2
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "out" / "train" / "manifest.json").read_text() == before
    assert shard(str(src), str(tmp_path / "out"), "--format", "imagefolder", "--on-error", "skip", "--force") == 0
    assert shard(str(src), str(src / "shards"), "--format", "imagefolder") == 2
    assert "lies inside the source" in capsys.readouterr().err and not (src / "shards").exists()


def test_paired_crop_flip_moves_image_and_labels_together():
    image = torch.arange(3 * 20 * 20, dtype=torch.float32).reshape(3, 20, 20)
    # Left half: l_eye (4); right half: background. Mirrored, the eye is on the right and is a right eye (5).
    labels = torch.zeros((1, 20, 20), dtype=torch.uint8)
    labels[..., :10] = 4
    perm = celebamask.flip_permutation()
    assert perm[4] == 5 and perm[6] == 7 and perm[8] == 9 and perm[15] == 15  # ear_r is the earring
    seen_flip = False
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        img, lab = paired_crop_flip(image, labels, g, size=20, flip_perm=perm, scale=(1.0, 1.0))
        flipped = bool(img[0, 0, 0] > img[0, 0, -1])
        assert torch.equal(img, image.flip(-1)) if flipped else torch.equal(img, image)
        assert (int(lab[0, 0, 0]), int(lab[0, 0, -1])) == ((0, 5) if flipped else (4, 0))
        seen_flip |= flipped
    assert seen_flip
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = paired_crop_flip(image, labels, g1, size=8)
    b = paired_crop_flip(image, labels, g2, size=8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[1].shape == (1, 8, 8)
    with pytest.raises(ValueError, match="differ in size"):
        paired_crop_flip(image, labels[..., :10], g1, size=8)


def test_uint8_images_are_resized_by_the_uint8_kernel_within_one_level_of_the_float_path():
    from hpctrain.data.paired import resize_bilinear, resize_nearest

    image = torch.randint(0, 256, (3, 60, 60), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    crop = image[..., 5:50, 7:52]  # a view, as the crop is
    fast = resize_bilinear(crop, 64)
    slow = torch.nn.functional.interpolate(crop[None].float(), size=(64, 64), mode="bilinear", antialias=True)[0]
    assert fast.dtype == torch.uint8 and fast.shape == (3, 64, 64)
    assert (fast.int() - slow.round().clamp(0, 255).int()).abs().max() <= 1
    assert resize_bilinear(crop.float(), 64).dtype == torch.float32
    gray = image[:1].expand(3, -1, -1)  # a grayscale face as _rgb makes it: stride 0 over the channels
    assert torch.equal(resize_bilinear(gray, 64), resize_bilinear(gray.contiguous(), 64))
    assert resize_bilinear(image[:1], 64).shape == (1, 64, 64)
    labels = torch.randint(0, 19, (1, 30, 30), dtype=torch.uint8)
    for dtype in (torch.uint8, torch.int64):
        out = resize_nearest(labels.to(dtype), 64)
        assert out.dtype == dtype and torch.equal(out.long(), resize_nearest(labels.float(), 64).long())


def test_celebamask_missing_download_says_how(tmp_path: Path):
    with pytest.raises(UserError, match="cannot be fetched by script"):
        celebamask.image_ids(tmp_path)
