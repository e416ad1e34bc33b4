"""Face parsing with real processes (torchrun, gloo on CPU): 2 processes train a small DeepLabV3+ on generated
faces and the loss falls; the outputs are written; 1 and 3 processes validate the checkpoint to identical metrics
(uneven split: one rank has no batch); hpctrain predict writes masks of the input's size and the comparison."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hpctrain.datasets.faces import make_faces
from tests.conftest import read_jsonl, run_hpctrain, train_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

SMALL = ["model.image_size=64", "model.aspp_channels=32", "model.decoder_channels=32", "train.global_batch_size=8",
         "train.micro_batch_size=4", "eval.micro_batch_size=2", "data.num_workers=0", "log.plots=false",
         "log.tensorboard=false"]


@pytest.fixture(scope="module")
def faces(tmp_path_factory) -> Path:
    # 40 faces: 32 train, 4 val, 4 test; 4 validation images in batches of 2 on 3 ranks: rank 2 has none.
    return make_faces(tmp_path_factory.mktemp("faces") / "set", 40, size=96, mask_size=48, seed=0)


@pytest.fixture(scope="module")
def trained(faces: Path, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run") / "faceseg"
    result = run_hpctrain(["train", "faceseg", f"model.data_root={faces}", f"run.dir={run_dir}", *SMALL,
                           "train.max_steps=24", "optim.lr=0.02", "eval.every_steps=12", "log.every_steps=1",
                           "log.outputs_every_steps=12", "ckpt.every_steps=12", "--nproc-per-node=2"], 400)
    assert result.returncode == 0, result.output
    assert "validation at step 24:" in result.output and "iou:" in result.output  # the per-class table and line
    return run_dir


def test_two_processes_reduce_the_loss_and_write_the_outputs(trained: Path):
    losses = train_losses(trained)
    assert sorted(losses) == list(range(1, 25))
    first, last = np.mean([losses[s] for s in (1, 2, 3)]), np.mean([losses[s] for s in (22, 23, 24)])
    assert last < 0.7 * first, (first, last)
    val = [r for r in read_jsonl(trained / "metrics.jsonl") if r["split"] == "val"]
    assert [r["step"] for r in val] == [12, 24]
    assert {"miou", "miou_fg", "pixel_acc", "mean_f1", "iou/background", "iou/skin"} <= set(val[-1])
    for tag in ("comparison", "curves"):
        pictures = sorted((trained / "images" / tag).glob("step_*.png"))
        assert [p.name for p in pictures] == ["step_0000012.png", "step_0000024.png"], tag
        assert Image.open(pictures[-1]).size[0] > 300


def test_validation_is_exact_for_1_and_3_processes(trained: Path, faces: Path):
    lines = {}
    for nproc in (1, 3):
        result = run_hpctrain(["eval", "faceseg", f"run.dir={trained}", f"model.data_root={faces}", *SMALL,
                               f"--nproc-per-node={nproc}"], 200)
        assert result.returncode == 0, result.output
        lines[nproc] = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines[1]) == 1 and len(lines[3]) == 1
    one, three = json.loads(lines[1][0]), json.loads(lines[3][0])
    # Counted metrics (everything from the confusion matrix) are identical. The loss is a float sum of the
    # forward's outputs, and one process computes with 2 threads where each of 3 uses 1: the last bit may differ.
    assert one.pop("loss") == pytest.approx(three.pop("loss"), rel=1e-6)
    assert one == three
    assert one["step"] == 24 and 0 < one["miou"] < 1 and len([k for k in one if k.startswith("iou/")]) >= 10


def test_predict_writes_masks_of_the_input_size_and_the_comparison(trained: Path, faces: Path, tmp_path: Path):
    image = tmp_path / "face.jpg"
    Image.open(next((faces / "CelebA-HQ-img").glob("*.jpg"))).resize((90, 70)).save(image)
    out = tmp_path / "pred"
    result = run_hpctrain(["predict", str(trained), str(image), "--out", str(out)], 120)
    assert result.returncode == 0, result.output
    assert Image.open(out / "face.png").size == (90, 70) and Image.open(out / "face.png").mode == "RGB"
    labels = np.asarray(Image.open(out / "face_labels.png"))
    assert labels.shape == (70, 90) and labels.max() < 19
    result = run_hpctrain(["predict", str(trained), "--compare", str(trained), "--out", str(out)], 120)
    assert result.returncode == 0, result.output
    assert Image.open(out / "comparison.png").size[0] > 400
    missing = run_hpctrain(["predict", str(trained), str(tmp_path / "nope.jpg"), "--out", str(out)], 60)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
