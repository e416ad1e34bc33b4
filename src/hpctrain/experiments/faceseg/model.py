"""DeepLabV3+ (Chen et al. 2018, "Encoder-Decoder with Atrous Separable Convolution") on a torchvision ResNet.

The backbone is a plain torchvision ResNet kept as ``self.backbone`` with its state-dict key names
(``backbone.layer1.0.conv1.weight``), so ImageNet or COCO weights load by name. Atrous convolution keeps layer4
(output stride 16) or layer3 and layer4 (output stride 8) at full resolution. The head follows the paper with
plain (not depthwise-separable) 3x3 convolutions, as the common PyTorch ports do. ``load_init`` reads initial
weights from torch's hub cache or a local file and never downloads: compute nodes often have no internet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlparse

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from hpctrain.errors import UserError, did_you_mean

BACKBONES = ("resnet18", "resnet34", "resnet50", "resnet101")
OUTPUT_STRIDES = (8, 16)
INITS = "scratch|imagenet|coco|PATH"

PARAMS_RESNET101 = 59_343_539
"""Parameters at the default configuration (ResNet-101, 19 classes, output stride 16, 256/48/256 channels):
42.50M backbone + 15.53M ASPP + 1.31M decoder and classifier. The source blog's "about 58M" matches ports whose
decoder has one 3x3 conv instead of the paper's two: 590,336 fewer, 58.75M."""

PARAMS_RESNET18 = 16_607_411
"""Parameters of the ResNet-18 variant with otherwise default settings (11.18M backbone + 5.43M head)."""


def conv_bn_relu(c_in: int, c_out: int, kernel: int = 1, dilation: int = 1) -> nn.Sequential:
    """Conv (no bias: the BatchNorm after it has one), BatchNorm, ReLU; 'same' padding."""
    pad = dilation * (kernel // 2)
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, padding=pad, dilation=dilation, bias=False),
                         nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class ASPP(nn.Module):
    """Atrous spatial pyramid pooling: a 1x1 conv, 3x3 convs at ``rates`` and image pooling, concatenated and
    projected to ``channels``, then dropout 0.1 (the official TensorFlow DeepLab's keep_prob 0.9; torchvision's
    DeepLabV3 head uses 0.5)."""

    def __init__(self, c_in: int, channels: int, rates: tuple[int, ...], dropout: float = 0.1) -> None:
        super().__init__()
        self.branches = nn.ModuleList([conv_bn_relu(c_in, channels)] +
                                      [conv_bn_relu(c_in, channels, 3, rate) for rate in rates])
        # No BatchNorm in the pooling branch: its input is 1x1 per image, so in training a batch of one gives
        # BatchNorm a single value per channel and it raises. A biased conv + ReLU is the usual fix; the BatchNorm
        # of the projection below normalises this branch together with the others.
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c_in, channels, 1), nn.ReLU(inplace=True))
        self.project = nn.Sequential(conv_bn_relu((len(rates) + 2) * channels, channels), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.interpolate(self.pool(x), size=x.shape[-2:], mode="bilinear", align_corners=False)
        return self.project(torch.cat([b(x) for b in self.branches] + [pooled], dim=1))


class Decoder(nn.Module):
    """Reduces the stride-4 features to ``low_channels``, concatenates the upsampled ASPP output, and refines
    with two 3x3 conv-BN-ReLU."""

    def __init__(self, c_low: int, low_channels: int, c_aspp: int, channels: int) -> None:
        super().__init__()
        self.reduce = conv_bn_relu(c_low, low_channels)
        self.fuse = nn.Sequential(conv_bn_relu(low_channels + c_aspp, channels, 3), conv_bn_relu(channels, channels, 3))

    def forward(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        high = F.interpolate(high, size=low.shape[-2:], mode="bilinear", align_corners=False)
        return self.fuse(torch.cat([self.reduce(low), high], dim=1))


def _dilate_basic_layer(layer: nn.Sequential, previous: int, dilation: int) -> None:
    """Turn a strided layer of BasicBlocks into an atrous one in place (torchvision's BasicBlock refuses
    dilation). As torchvision does for Bottleneck: the conv that had the stride keeps the previous dilation, every
    3x3 conv after it gets the new one, so each output sees the same receptive field as before."""
    first = layer[0]
    first.stride = 1
    first.conv1.stride, first.conv1.dilation, first.conv1.padding = (1, 1), (previous,) * 2, (previous,) * 2
    if first.downsample is not None:
        first.downsample[0].stride = (1, 1)
    for i, block in enumerate(layer):
        for conv in ([block.conv2] if i == 0 else [block.conv1, block.conv2]):
            conv.dilation, conv.padding = (dilation, dilation), (dilation, dilation)


def build_backbone(name: str, output_stride: int) -> nn.Module:
    """A torchvision ResNet (random weights) with layer4, or layer3 and layer4, atrous instead of strided."""
    if name not in BACKBONES:
        raise UserError(f"backbone {name!r} is not supported.{did_you_mean(name, BACKBONES)}",
                        f"choose one of {', '.join(BACKBONES)}.")
    if output_stride not in OUTPUT_STRIDES:
        raise UserError(f"output_stride={output_stride} is not supported", "choose 16 (the default) or 8.")
    dilate = [False, output_stride == 8, True]  # layer2, layer3, layer4
    if name in ("resnet18", "resnet34"):
        net = getattr(torchvision.models, name)(weights=None)
        if output_stride == 8:
            _dilate_basic_layer(net.layer3, 1, 2)
        _dilate_basic_layer(net.layer4, 2 if output_stride == 8 else 1, 4 if output_stride == 8 else 2)
    else:
        net = getattr(torchvision.models, name)(weights=None, replace_stride_with_dilation=dilate)
    # Identity (parameter-free) rather than deleting: the key names stay torchvision's and ResNet.forward still runs.
    net.fc, net.avgpool = nn.Identity(), nn.Identity()
    return net


class DeepLabV3Plus(nn.Module):
    """DeepLabV3+: ResNet -> ASPP at stride ``output_stride`` -> decoder at stride 4 -> logits
    N x num_classes x H x W at the input size (any H, W)."""

    def __init__(self, num_classes: int = 19, backbone: str = "resnet101", output_stride: int = 16,
                 aspp_rates: tuple[int, ...] = (6, 12, 18), aspp_channels: int = 256, low_level_channels: int = 48,
                 decoder_channels: int = 256) -> None:
        super().__init__()
        self.backbone_name, self.output_stride = backbone, output_stride
        self.backbone = build_backbone(backbone, output_stride)
        # A layer's output width is the input width of the next block (layer4 has >= 2 blocks in every ResNet).
        c_high = self.backbone.layer4[-1].conv1.in_channels
        c_low = self.backbone.layer2[0].conv1.in_channels
        rates = tuple(r * 16 // output_stride for r in aspp_rates)  # same field of view in pixels at stride 8
        self.aspp = ASPP(c_high, aspp_channels, rates)
        self.decoder = Decoder(c_low, low_level_channels, aspp_channels, decoder_channels)
        self.classifier = nn.Conv2d(decoder_channels, num_classes, 1)
        self._init_head()

    def _init_head(self) -> None:
        """He init for the head's convs, as torchvision does for the ResNet (PyTorch's default is a scaled
        uniform meant for linear layers)."""
        for m in [*self.aspp.modules(), *self.decoder.modules(), self.classifier]:
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer1 output at stride 4, layer4 output at stride ``output_stride``)."""
        b = self.backbone
        low = b.layer1(b.maxpool(b.relu(b.bn1(b.conv1(x)))))
        return low, b.layer4(b.layer3(b.layer2(low)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low, high = self.features(x)
        logits = self.classifier(self.decoder(low, self.aspp(high)))
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)

    def backbone_parameters(self) -> list[nn.Parameter]:
        """The ResNet's parameters (trained with a lower learning rate when pretrained)."""
        return list(self.backbone.parameters())

    def head_parameters(self) -> list[nn.Parameter]:
        """Every parameter outside the ResNet: ASPP, decoder, classifier."""
        return [p for name, p in self.named_parameters() if not name.startswith("backbone.")]


# --- initial weights -----------------------------------------------------------------------------------------------

def load_init(model: DeepLabV3Plus, init: str) -> str:
    """Load ``init`` into ``model``; returns one line saying what was loaded.

    scratch: nothing. imagenet: torchvision's default ImageNet weights of the same ResNet
    (``get_model_weights(name).DEFAULT``: IMAGENET1K_V2 for resnet50/101, the better of the two, and V1, the only
    one, for resnet18/34). coco: the backbone of torchvision's COCO-trained DeepLabV3 (resnet50/101 only). PATH: a
    .pt/.pth/.safetensors state dict of a torchvision ResNet, a torchvision DeepLabV3 or a DeepLabV3Plus. The
    pretrained files are read from torch's hub cache, never downloaded."""
    if init == "scratch":
        return "init=scratch: random weights"
    if init in ("imagenet", "coco"):
        weights = _imagenet_weights(model) if init == "imagenet" else _coco_weights(model)
        path = _cached_file(weights, init)
        n = _load_backbone(model, _read_state_dict(path), path)
        return f"init={init}: {n} backbone tensors of {weights} from {path}"
    path = Path(init).expanduser()
    if not path.is_file():
        raise UserError(f"model.init={init!r} is neither a known init nor an existing file."
                        f"{did_you_mean(init, ('scratch', 'imagenet', 'coco'))}",
                        f"use one of {INITS} (PATH: a local .pt/.pth/.safetensors state dict).")
    state = _read_state_dict(path)
    if any(k.startswith("aspp.") for k in state):  # a DeepLabV3Plus checkpoint: head included
        _check_keys(model.state_dict(), state, path, "a DeepLabV3Plus state dict of the same configuration")
        model.load_state_dict(state, strict=False)  # strict=False only for num_batches_tracked, checked above
        return f"init={path}: all {len(state)} tensors of a DeepLabV3Plus"
    return f"init={path}: {_load_backbone(model, state, path)} backbone tensors"


def _imagenet_weights(model: DeepLabV3Plus) -> Any:
    return torchvision.models.get_model_weights(model.backbone_name).DEFAULT


def _coco_weights(model: DeepLabV3Plus) -> Any:
    seg = torchvision.models.segmentation
    table = {"resnet50": seg.DeepLabV3_ResNet50_Weights, "resnet101": seg.DeepLabV3_ResNet101_Weights}
    if model.backbone_name not in table:
        raise UserError(f"model.init=coco needs backbone resnet50 or resnet101, not {model.backbone_name} "
                        "(torchvision has COCO DeepLabV3 weights only for those)",
                        "set model.backbone=resnet101, or use model.init=imagenet|scratch|PATH.")
    return table[model.backbone_name].COCO_WITH_VOC_LABELS_V1


def _cached_file(weights: Any, init: str) -> Path:
    """Where torch.hub would have stored ``weights``; a clear error (what to fetch, where to put it) if absent."""
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    name = Path(urlparse(weights.url).path).name
    if not (folder / name).is_file():
        raise UserError(f"model.init={init} needs torchvision's {weights} ({name}), which is not in {folder}; "
                        "it is never downloaded during training",
                        f"on a machine with internet fetch {weights.url} and put it at {folder / name} (the "
                        "folder follows $TORCH_HOME: <TORCH_HOME>/hub/checkpoints), or set model.init=PATH to a "
                        "local state dict.")
    return folder / name


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors or torch file: nested "state_dict"/"model" unwrapped, the "module." (DDP)
    and "_orig_mod." (torch.compile) prefixes stripped."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip and header errors have no common base class
        raise UserError(f"cannot read {path} as a state dict: {type(err).__name__}: {err}",
                        "give a .pt/.pth saved with torch.save(model.state_dict()) or a .safetensors file.") from err
    while isinstance(state, Mapping) and isinstance(state.get("state_dict", state.get("model")), Mapping):
        state = state.get("state_dict", state.get("model"))
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path} does not hold a state dict (a mapping of names to tensors)",
                        "save one with torch.save(model.state_dict(), PATH).")
    return {_strip(k): v for k, v in state.items()}


def _strip(key: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        while key.startswith(prefix):
            key = key[len(prefix):]
    return key


def _load_backbone(model: DeepLabV3Plus, state: Mapping[str, torch.Tensor], path: Path) -> int:
    """Load a ResNet's (``fc.*`` ignored) or a DeepLabV3's (``backbone.*`` only) tensors into model.backbone."""
    if any(k.startswith("backbone.") for k in state):
        state = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
    state = {k: v for k, v in state.items() if not k.startswith("fc.")}
    _check_keys(model.backbone.state_dict(), state, path,
                f"a torchvision {model.backbone_name} state dict (keys like layer1.0.conv1.weight, or "
                "backbone.layer1.0.conv1.weight from a DeepLabV3)")
    model.backbone.load_state_dict(state, strict=False)  # strict=False only for num_batches_tracked, checked
    return len(state)


def _check_keys(expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor], path: Path, what: str) -> None:
    """UserError unless ``got`` has exactly the keys and shapes of ``expected``. BatchNorm's num_batches_tracked
    may be missing: older torchvision files lack it, and BatchNorm fills it in."""
    missing = [k for k in expected if k not in got and not k.endswith("num_batches_tracked")]
    extra = [k for k in got if k not in expected]
    shapes = [f"{k} {tuple(got[k].shape)} (expected {tuple(expected[k].shape)})"
              for k in got if k in expected and got[k].shape != expected[k].shape]
    if not (missing or extra or shapes):
        return
    if len(extra) == len(got):
        problem = f"none of its {len(got)} keys match; it holds e.g. {', '.join(list(got)[:4])}"
    else:
        parts = [f"{len(missing)} missing (e.g. {', '.join(missing[:3])})" if missing else "",
                 f"{len(extra)} unexpected (e.g. {', '.join(extra[:3])})" if extra else "",
                 f"{len(shapes)} of another shape (e.g. {'; '.join(shapes[:3])})" if shapes else ""]
        problem = "its keys differ: " + ", ".join(p for p in parts if p)
    raise UserError(f"{path} is not {what}: {problem}",
                    "check that the file matches model.backbone (and, for a full DeepLabV3Plus, the class and "
                    f"channel counts), or use model.init={INITS}.")
