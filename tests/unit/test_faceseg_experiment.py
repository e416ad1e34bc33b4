"""The face-parsing experiment in one process: its data paths, flip, loss, metrics, predictions, options."""

from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.config.load import load_config
from hpctrain.datasets.fixtures import make_celebamask
from hpctrain.datasets.sources import celebamask
from hpctrain.errors import UserError
from hpctrain.experiments.faceseg.experiment import FaceSegCelebAMask, FaceSegGenerated

SMALL = ("model.backbone=resnet18", "model.image_size=64", "model.aspp_channels=32", "model.decoder_channels=32",
         "model.init=scratch")


def experiment(*overrides: str, cls=FaceSegGenerated):
    cfg = load_config(cls.name, cls.config_class, experiment_defaults=cls.defaults, overrides=(*SMALL, *overrides))
    return cls(cfg)


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return make_celebamask(tmp_path_factory.mktemp("celeba"), count=20, size=96, mask_size=48, standard_split=True)


@pytest.fixture(scope="module")
def shards(release: Path, tmp_path_factory) -> Path:
    from hpctrain.datasets.shard_writer import ShardRequest, write_shards

    out = tmp_path_factory.mktemp("shards")
    assert write_shards(ShardRequest(source=release, out=out, format="celebamask", shard_size=1 << 20, resize=80)) == 0
    return out


def test_release_layout_samples(release: Path):
    ds = experiment(f"model.data_root={release}", "model.source=celebamask").build_datasets()
    image, labels = ds.val[0]
    assert image.shape == (3, 64, 64) and image.dtype == torch.uint8
    assert labels.shape == (64, 64) and labels.dtype == torch.uint8
    assert set(np.unique(labels.numpy())) <= set(range(19)) and labels.max() > 0
    gen = torch.Generator().manual_seed(0)
    image, labels = ds.train_transform(ds.train[0], gen)
    assert image.shape == (3, 64, 64) and labels.shape == (64, 64)


def test_shard_and_gpu_decode_paths_agree(shards: Path):
    """The loader-decoded and the encoded (GPU-decode, here on the CPU) paths give the same validation batch:
    images within JPEG-decoder rounding, labels exactly."""
    from hpctrain.data.gpu_decode import collate_encoded

    cpu = experiment(f"model.data_root={shards}", "model.source=shards").build_datasets()
    enc = experiment(f"model.data_root={shards}", "model.source=shards", "model.gpu_decode=true").build_datasets()
    image, labels = cpu.val[1]
    batch = collate_encoded([enc.val[1]])
    decoded = batch.decode(torch.device("cpu"), 64)
    assert torch.equal(batch.rest[0][0], labels)
    assert (decoded[0] * 255 - image.float()).abs().mean() < 2.0
    # Training: the drawn crop is applied to the labels in the loader.
    sample = enc.train_transform(enc.train[0], torch.Generator().manual_seed(3))
    assert sample[2].shape == (64, 64)


def test_flip_swaps_left_and_right_classes():
    from hpctrain.experiments.faceseg.data import crop_flip, encoded_crop_flip

    labels = torch.zeros(8, 8, dtype=torch.uint8)
    left_eye, right_eye = celebamask.CLASSES.index("l_eye"), celebamask.CLASSES.index("r_eye")
    labels[2, 1] = left_eye
    labels[2, 6] = right_eye
    labels[1, 1] = celebamask.CLASSES.index("l_brow")  # one brow only: the mirrored map differs from the map
    image = torch.zeros(3, 8, 8, dtype=torch.uint8)
    mirrored = celebamask.flip_permutation()[labels.long()].flip(-1)
    assert mirrored[2, 1] == left_eye and mirrored[2, 6] == right_eye  # the eyes change sides and names
    assert mirrored[1, 6] == celebamask.CLASSES.index("r_brow") and mirrored[1, 1] == 0
    flips = 0
    for seed in range(20):  # some seeds flip, some do not
        _, out = crop_flip((image, labels), torch.Generator().manual_seed(seed), 8, (1.0, 1.0))
        _, crop, enc = encoded_crop_flip((torch.zeros(4, dtype=torch.uint8), labels),
                                         torch.Generator().manual_seed(seed), 8, (1.0, 1.0))
        assert torch.equal(enc.long(), mirrored if crop.flip else labels.long())
        assert torch.equal(out.long(), labels.long()) or torch.equal(out.long(), mirrored)
        flips += not torch.equal(out.long(), labels.long())
    assert 0 < flips < 20


def test_loss_metrics_and_prediction_sizes(release: Path):
    exp = experiment(f"model.data_root={release}", "model.source=celebamask")
    ds = exp.build_datasets()
    torch.manual_seed(0)
    model = exp.build_model()
    batch = [torch.stack(t) for t in zip(*[ds.val[i] for i in range(2)])]
    loss = exp.train_loss(model, batch)
    assert loss.ndim == 0 and torch.isfinite(loss) and 1.0 < loss.item() < 10.0  # ~ln(19) at init
    model.eval()
    stats = exp.eval_stats(model, batch)
    assert stats["confusion"].shape == (19, 19) and int(stats["confusion"].sum()) == 2 * 64 * 64
    assert stats["count"].item() == 2 * 64 * 64
    m = exp.metrics({"loss_sum": float(stats["loss_sum"]), "count": float(stats["count"]),
                     "confusion": stats["confusion"].double()})
    assert 0 <= m["miou"] <= 1 and 0 <= m["pixel_acc"] <= 1 and "iou/background" in m
    preds = exp.predict(model, [torch.randint(0, 256, (3, 50, 70), dtype=torch.uint8)])
    assert preds[0].shape == (50, 70) and preds[0].max() < 19
    assert "mean" in exp.describe_metrics(m)


def test_param_groups_lower_backbone_rate_only_when_pretrained():
    exp = experiment("model.init=imagenet", "model.backbone_lr_scale=0.1")
    model = exp.build_model()
    groups = exp.param_groups(model)
    assert [g["lr_scale"] for g in groups] == [0.1, 1.0]
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert [g["lr_scale"] for g in experiment().param_groups(model)] == [1.0, 1.0]


def test_init_imagenet_without_the_file_says_where_to_put_it(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    exp = experiment("model.init=imagenet")
    with pytest.raises(UserError) as err:
        exp.init_weights(exp.build_model())
    assert ".pth" in str(err.value) and str(tmp_path) in str(err.value)


@pytest.mark.parametrize("override, message", [
    ("model.class_weights=[1.0, 2.0]", "needs 19"),
    ("model.crop_scale=[0.9, 0.5]", "crop_scale"),
    ("model.gpu_decode=true", "reads shards"),
    ("model.image_size=16", "too small"),
])
def test_bad_options_are_refused(override: str, message: str):
    with pytest.raises(UserError, match=message):
        experiment("model.source=celebamask", override)


def test_reference_defaults_match_the_source():
    cfg = load_config(FaceSegCelebAMask.name, FaceSegCelebAMask.config_class,
                      experiment_defaults=FaceSegCelebAMask.defaults,
                      config_file=Path(__file__).resolve().parents[2] / "configs" / "faceseg_pretrained.toml")
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.epochs) == (96, 16, 100)
    assert (cfg.model.backbone, cfg.model.image_size, cfg.model.init) == ("resnet101", 256, "imagenet")
    scratch = load_config(FaceSegCelebAMask.name, FaceSegCelebAMask.config_class,
                          experiment_defaults=FaceSegCelebAMask.defaults,
                          config_file=Path(__file__).resolve().parents[2] / "configs" / "faceseg_scratch.toml")
    assert (scratch.train.epochs, scratch.model.init) == (200, "scratch") and scratch.optim.lr > cfg.optim.lr


def test_initial_weights_load_only_on_a_fresh_start(tmp_path: Path, monkeypatch):
    """A resumed run takes its weights from the checkpoint and must not need the pretrained file."""
    from types import SimpleNamespace

    from hpctrain.train import run

    exp = experiment("model.init=imagenet", f"run.dir={tmp_path}")
    calls = []
    monkeypatch.setattr(type(exp), "init_weights", lambda self, model: calls.append(model) or "loaded")
    runtime = SimpleNamespace(is_main=True, distributed=False)
    monkeypatch.setattr(run, "select_checkpoint", lambda *a, **k: (object(), []))  # a checkpoint to resume
    run.init_weights(exp, "model", exp.cfg, runtime)
    assert calls == []
    monkeypatch.setattr(run, "select_checkpoint", lambda *a, **k: (None, []))  # a fresh start
    run.init_weights(exp, "model", exp.cfg, runtime)
    assert calls == ["model"]
    # Only rank 0 reads the file (DDP's constructor broadcasts its weights).
    run.init_weights(exp, "model", exp.cfg, SimpleNamespace(is_main=False, distributed=False))
    assert calls == ["model"]
    # Rank 0's error reaches the caller as a UserError every rank raises.
    monkeypatch.setattr(type(exp), "init_weights", lambda self, model: (_ for _ in ()).throw(UserError("no file", "put it")))
    with pytest.raises(UserError, match="no file") as err:
        run.init_weights(exp, "model", exp.cfg, runtime)
    assert err.value.hint == "put it" and getattr(err.value, "on_every_rank", False)


def test_predict_reads_8_and_16_bit_images_and_refuses_folders(tmp_path: Path):
    from PIL import Image

    from hpctrain.experiments.faceseg.predict import read_image

    Image.fromarray(np.full((5, 7, 3), 200, np.uint8)).save(tmp_path / "rgb.png")
    Image.fromarray(np.full((5, 7), 40000, np.uint16)).save(tmp_path / "deep.png")
    rgb, deep = read_image(tmp_path / "rgb.png"), read_image(tmp_path / "deep.png")
    assert rgb.shape == deep.shape == (3, 5, 7) and rgb.dtype == deep.dtype == torch.uint8
    assert int(rgb[0, 0, 0]) == 200 and int(deep[0, 0, 0]) == 40000 >> 8
    with pytest.raises(UserError, match="is a folder"):
        read_image(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        read_image(tmp_path / "none.jpg")


def test_missing_generated_faces_say_how_to_make_them(tmp_path: Path):
    with pytest.raises(UserError, match="no generated faces") as err:
        experiment(f"model.data_root={tmp_path / 'faces'}").build_datasets()
    assert "hpctrain synth faces" in err.value.hint
