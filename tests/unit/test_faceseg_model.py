from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from hpctrain.errors import UserError
from hpctrain.experiments.faceseg.model import PARAMS_RESNET18, PARAMS_RESNET101, DeepLabV3Plus, load_init

# Narrow head channels keep the ResNet-18 tests fast; the backbone is the real one.
SMALL = dict(backbone="resnet18", aspp_channels=32, decoder_channels=32)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def small(**kw) -> DeepLabV3Plus:
    return DeepLabV3Plus(**{**SMALL, **kw})


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty torch hub dir; load_init must look for cached weights here and nowhere else."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    return tmp_path / "hub"


def random_resnet18_state() -> dict[str, torch.Tensor]:
    net = torchvision.models.resnet18(weights=None)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_()
    return net.state_dict()


# --- architecture --------------------------------------------------------------------------------------------------

def test_parameter_counts_match_the_constants():
    assert n_params(DeepLabV3Plus()) == PARAMS_RESNET101 == 59_343_539
    assert n_params(DeepLabV3Plus(backbone="resnet18")) == PARAMS_RESNET18 == 16_607_411


@pytest.mark.parametrize("size", [(64, 64), (250, 250), (67, 93)])
def test_logits_have_the_input_size(size):
    model = small().eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, *size)).shape == (2, 19, *size)


@pytest.mark.parametrize("backbone", ["resnet18", "resnet50"])
@pytest.mark.parametrize("output_stride", [16, 8])
def test_features_are_at_stride_4_and_the_output_stride(backbone, output_stride):
    model = small(backbone=backbone, output_stride=output_stride).eval()
    with torch.no_grad():
        low, high = model.features(torch.randn(1, 3, 64, 64))
    assert low.shape[-2:] == (16, 16)
    assert high.shape[-2:] == (64 // output_stride,) * 2
    assert model.aspp.branches[1][0].dilation == ((6, 6) if output_stride == 16 else (12, 12))


@pytest.mark.parametrize("output_stride", [16, 8])
def test_hand_dilated_basic_blocks_compute_the_strided_network_densely(output_stride):
    """Atrous conversion is exact: the dilated ResNet-18 sampled every 32/output_stride pixels equals the
    plain one (eval mode, even sizes), so every stride, dilation and padding was set consistently."""
    plain = torchvision.models.resnet18(weights=None).eval()
    model = small(output_stride=output_stride).eval()
    model.backbone.load_state_dict({k: v for k, v in plain.state_dict().items() if not k.startswith("fc.")})
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        stem = plain.maxpool(plain.relu(plain.bn1(plain.conv1(x))))
        expected = plain.layer4(plain.layer3(plain.layer2(plain.layer1(stem))))
        _, high = model.features(x)
    step = 32 // output_stride
    torch.testing.assert_close(high[..., ::step, ::step], expected, atol=1e-4, rtol=1e-4)


def test_unknown_backbone_or_output_stride_names_the_choices():
    with pytest.raises(UserError, match="resnet18, resnet34, resnet50, resnet101"):
        DeepLabV3Plus(backbone="resnet152")
    with pytest.raises(UserError, match="16.*8"):
        DeepLabV3Plus(backbone="resnet18", output_stride=32)


def test_backbone_and_head_parameters_are_disjoint_and_complete():
    model = small()
    backbone, head = model.backbone_parameters(), model.head_parameters()
    ids_b, ids_h = {id(p) for p in backbone}, {id(p) for p in head}
    assert ids_b and ids_h and not ids_b & ids_h
    assert ids_b | ids_h == {id(p) for p in model.parameters()}
    assert ids_b == {id(p) for p in model.backbone.parameters()}
    assert "backbone.layer1.0.conv1.weight" in model.state_dict()


def test_channels_last_bf16_autocast_forward():
    model = small().to(memory_format=torch.channels_last).eval()
    x = torch.randn(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.shape == (2, 19, 64, 64) and torch.isfinite(out.float()).all()


def test_batch_of_one_trains():
    """The image-pooling branch has a 1x1 map per image; with BatchNorm there, a batch of one would raise."""
    model = small().train()
    model(torch.randn(1, 3, 64, 64)).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


# --- initial weights -----------------------------------------------------------------------------------------------

def test_scratch_loads_nothing():
    model = small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert "scratch" in load_init(model, "scratch")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_imagenet_without_cached_file_says_what_to_fetch_and_where(hub):
    with pytest.raises(UserError) as err:
        load_init(small(), "imagenet")
    text = str(err.value)
    assert "resnet18-f37072fd.pth" in text and "ResNet18_Weights.IMAGENET1K_V1" in text
    assert str(hub / "checkpoints") in text
    assert "https://download.pytorch.org/models/resnet18-f37072fd.pth" in text and "model.init=PATH" in text
    assert not (hub / "checkpoints").exists()  # nothing was downloaded


def test_imagenet_loads_from_the_hub_cache(hub):
    weights = torchvision.models.ResNet18_Weights.DEFAULT
    path = hub / "checkpoints" / Path(urlparse(weights.url).path).name
    path.parent.mkdir(parents=True)
    state = random_resnet18_state()
    torch.save(state, path)
    model = small()
    desc = load_init(model, "imagenet")
    assert "IMAGENET1K_V1" in desc and str(path) in desc
    torch.testing.assert_close(model.backbone.layer3[1].conv2.weight, state["layer3.1.conv2.weight"], rtol=0, atol=0)


def test_coco_is_only_for_resnet50_and_101(hub):
    with pytest.raises(UserError, match="resnet50 or resnet101"):
        load_init(small(), "coco")


def test_coco_without_cached_file_names_it(hub):
    model = DeepLabV3Plus(backbone="resnet50", aspp_channels=32, decoder_channels=32)
    with pytest.raises(UserError, match="deeplabv3_resnet50_coco-cd0a2569.pth"):
        load_init(model, "coco")


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_a_torchvision_resnet_file_loads_and_fc_is_ignored(tmp_path, suffix):
    state = random_resnet18_state()
    path = tmp_path / f"r18{suffix}"
    torch.save(state, path) if suffix == ".pth" else save_file(state, str(path))
    model = small()
    desc = load_init(model, str(path))
    assert f"{len(state) - 2} backbone tensors" in desc  # fc.weight, fc.bias ignored
    assert torch.equal(model.backbone.conv1.weight, state["conv1.weight"])
    assert torch.equal(model.backbone.layer4[1].bn2.running_var, state["layer4.1.bn2.running_var"])


def test_a_deeplabv3_style_file_loads_its_backbone(tmp_path):
    state = {f"backbone.{k}": v for k, v in random_resnet18_state().items() if not k.startswith("fc.")}
    state["classifier.4.weight"] = torch.randn(21, 256, 1, 1)
    state["aux_classifier.4.weight"] = torch.randn(21, 256, 1, 1)
    path = tmp_path / "deeplabv3.pt"
    torch.save({"model": state, "epoch": 3}, path)
    model = small()
    assert "backbone tensors" in load_init(model, str(path))
    assert torch.equal(model.backbone.layer2[0].downsample[0].weight, state["backbone.layer2.0.downsample.0.weight"])


def test_a_full_deeplabv3plus_state_dict_loads_everything_with_prefixes_stripped(tmp_path):
    source = small()
    with torch.no_grad():
        for p in source.parameters():
            p.normal_()
    path = tmp_path / "ckpt.pt"
    torch.save({"state_dict": {f"module._orig_mod.{k}": v for k, v in source.state_dict().items()}}, path)
    model = small()
    assert "DeepLabV3Plus" in load_init(model, str(path))
    for k, v in source.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_unrelated_keys_give_a_clear_error(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"encoder.blocks.0.weight": torch.randn(3), "decoder.out.bias": torch.randn(2)}, path)
    with pytest.raises(UserError, match=r"layer1\.0\.conv1\.weight.*none of its 2 keys.*encoder\.blocks\.0\.weight"):
        load_init(small(), str(path))


def test_wrong_shapes_or_another_depth_give_a_clear_error(tmp_path):
    state = random_resnet18_state()
    state["layer1.0.conv1.weight"] = torch.randn(64, 64, 1, 1)
    path = tmp_path / "bad.pt"
    torch.save(state, path)
    with pytest.raises(UserError, match=r"another shape.*layer1\.0\.conv1\.weight \(64, 64, 1, 1\)"):
        load_init(small(), str(path))
    torch.save(torchvision.models.resnet34(weights=None).state_dict(), path)
    with pytest.raises(UserError, match="unexpected.*layer1.2"):
        load_init(small(), str(path))


def test_unknown_init_lists_the_choices(tmp_path):
    with pytest.raises(UserError, match=r"scratch\|imagenet\|coco\|PATH") as err:
        load_init(small(), "imagnet")
    assert "Did you mean 'imagenet'" in str(err.value)
    garbage = tmp_path / "junk.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot read"):
        load_init(small(), str(garbage))
