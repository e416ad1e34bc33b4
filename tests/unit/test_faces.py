"""The generated face set (hpctrain.datasets.faces): the CelebAMask-HQ layout as celebamask reads it, determinism,
every class present, the left/right convention under a flip, images that show what the labels say, and
`hpctrain shard` packing it."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hpctrain.cli import main
from hpctrain.datasets import faces
from hpctrain.datasets.sources import celebamask
from hpctrain.errors import UserError

C = {name: i for i, name in enumerate(celebamask.CLASSES)}


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sixty(tmp_path_factory) -> tuple[Path, list[np.ndarray], list[np.ndarray]]:
    """60 faces at 128 px (masks 64): the images as RGB arrays and their label maps at 128."""
    root = faces.make_faces(tmp_path_factory.mktemp("faces") / "set", 60, size=128, mask_size=64, seed=1)
    images = [np.asarray(Image.open(root / celebamask.IMAGES / f"{i}.jpg").convert("RGB"), np.float32) / 255
              for i in range(60)]
    labels = [celebamask.label_map(root, i, (128, 128)) for i in range(60)]
    return root, images, labels


def test_the_layout_is_the_release_layout(tmp_path: Path):
    root = faces.make_faces(tmp_path, 10, size=64, mask_size=32)
    ids = celebamask.image_ids(root)
    assert ids == list(range(10))
    assert {k: len(v) for k, v in celebamask.splits(root, ids).items()} == {"train": 8, "val": 1, "test": 1}
    with Image.open(root / celebamask.IMAGES / "3.jpg") as img:
        assert img.format == "JPEG" and img.size == (64, 64)
    masks = sorted((root / celebamask.MASKS / "0").glob("00003_*.png"))
    assert {"00003_skin.png", "00003_cloth.png", "00003_u_lip.png"} <= {p.name for p in masks}
    for path in masks:
        with Image.open(path) as m:
            assert m.mode == "L" and m.size == (32, 32)
            assert set(np.unique(np.asarray(m)).tolist()) <= {0, 255}
    assert celebamask.label_map(root, 3).shape == (32, 32)
    (image_id, data, labels), *_ = celebamask.samples(root, [5, 6], resize=0)
    assert image_id == 5 and labels.shape == (64, 64) and labels.max() < len(celebamask.CLASSES)
    assert Image.open(io.BytesIO(data)).size == (64, 64)


def test_same_seed_same_bytes_and_parts_join_up(tmp_path: Path):
    whole = faces.make_faces(tmp_path / "whole", 6, size=48, mask_size=24, seed=3)
    parts = tmp_path / "parts"
    faces.make_faces(parts, 2, size=48, mask_size=24, seed=3, start_id=4)  # out of order: the split files follow
    faces.make_faces(parts, 4, size=48, mask_size=24, seed=3)
    assert tree(whole) == tree(parts)
    other = faces.make_faces(tmp_path / "other", 6, size=48, mask_size=24, seed=4)
    assert (other / celebamask.IMAGES / "0.jpg").read_bytes() != (whole / celebamask.IMAGES / "0.jpg").read_bytes()


def test_every_class_occurs(sixty):
    _, _, labels = sixty
    counts = np.bincount(np.concatenate([x.ravel() for x in labels]), minlength=len(celebamask.CLASSES))
    assert (counts > 0).all(), [celebamask.CLASSES[c] for c in np.flatnonzero(counts == 0)]


def columns(labels: np.ndarray, name: str) -> float | None:
    cols = np.nonzero(labels == C[name])[1]
    return float(cols.mean()) if cols.size else None


def test_left_parts_lie_on_the_image_left_and_a_flip_keeps_the_convention(sixty):
    """l_* is the viewer's left (faces.LEFT): in every face, and in its mirror image relabelled with
    celebamask.flip_permutation(), which is then again a face of the same kind."""
    _, _, labels = sixty
    flip = celebamask.flip_permutation().numpy()
    checked = 0
    for lab in labels:
        for view in (lab, flip[lab][:, ::-1]):
            for part in ("eye", "brow", "ear"):
                left, right = columns(view, f"l_{part}"), columns(view, f"r_{part}")
                if left is not None and right is not None:
                    assert (left < right) == (faces.LEFT < 0), part
                    checked += 1
    assert checked > 200


def test_a_flipped_face_is_labelled_as_its_mirror_image():
    """Flipping a face's label map and swapping l/r with celebamask.flip_permutation() gives the labels the
    generator draws for the mirrored face: the sides are named consistently, whatever the pose."""
    flip = celebamask.flip_permutation().numpy()
    for i in range(40):
        f = faces.sample_face(np.random.default_rng([5, i]))
        labels, _ = faces.paint(faces.part_masks(f, *faces.face_grid(f, 96)))
        mirrored, _ = faces.paint(faces.part_masks(faces.mirror_face(f), *faces.face_grid(faces.mirror_face(f), 96)))
        assert (flip[labels][:, ::-1] == mirrored).mean() > 0.999


def mean_colour(image: np.ndarray, labels: np.ndarray, name: str) -> np.ndarray | None:
    sel = labels == C[name]
    return image[sel].mean(0) if sel.sum() >= 4 else None


def test_the_pixels_show_what_the_labels_say(sixty):
    _, images, labels = sixty
    votes: dict[str, list[bool]] = {"sclera": [], "brow": [], "lips": [], "hair": [], "nose": []}
    for image, lab in zip(images, labels):
        skin = mean_colour(image, lab, "skin")
        brightness = image.mean(-1)
        eye = brightness[lab == C["l_eye"]]
        if eye.size >= 8:  # white sclera and a dark iris: the eye spans more brightness than the skin
            votes["sclera"].append(np.percentile(eye, 90) > skin.mean() and np.percentile(eye, 10) < skin.mean())
        brow, lip, hair = (mean_colour(image, lab, p) for p in ("l_brow", "l_lip", "hair"))
        nose = mean_colour(image, lab, "nose")
        if brow is not None:
            votes["brow"].append(brow.mean() < skin.mean())
        if lip is not None:
            votes["lips"].append(lip[0] - lip[1] > skin[0] - skin[1])
        if hair is not None:
            votes["hair"].append(np.abs(hair - skin).sum() > 0.1)
        if nose is not None:
            votes["nose"].append(nose.mean() < skin.mean())
    for what, vote in votes.items():
        assert len(vote) >= 30 and np.mean(vote) >= 0.85, (what, np.mean(vote))


def test_hpctrain_shard_packs_it(tmp_path: Path):
    src = faces.make_faces(tmp_path / "src", 10, size=64, mask_size=32)
    assert main(["shard", str(src), str(tmp_path / "out"), "--format", "celebamask", "--resize", "64"]) == 0
    for split in ("train", "val", "test"):
        assert (tmp_path / "out" / split / "index.json").exists()


@pytest.mark.parametrize("kwargs", [{"count": 0}, {"count": 3, "start_id": -1}, {"count": 3, "size": 8},
                                    {"count": 3, "mask_size": 4}])
def test_bad_arguments(tmp_path: Path, kwargs):
    with pytest.raises(UserError):
        faces.make_faces(tmp_path, **kwargs)
