"""MiniResNet: the small ResNet of the modular-DDP guide (seeds/003): residual blocks with
channels doubling as the resolution halves. The normalisation is selectable because
batch norm makes a sample's output depend on its batch-mates, which the world-size
equivalence tests must exclude."""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

Norm = Literal["batch", "group", "none"]


def make_norm(kind: Norm, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(min(8, channels), channels)
    return nn.Identity()


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: Norm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=norm == "none")
        self.norm1 = make_norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=norm == "none")
        self.norm2 = make_norm(norm, cout)
        self.act = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), make_norm(norm, cout))

    def forward(self, x: Tensor) -> Tensor:
        out = self.act(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.act(out + self.shortcut(x))


class MiniResNet(nn.Module):
    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32, norm: Norm = "batch") -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=norm == "none"), make_norm(norm, width), nn.ReLU(inplace=True)
        )
        self.layers = nn.Sequential(
            BasicBlock(width, width, 1, norm),
            BasicBlock(width, 2 * width, 2, norm),
            BasicBlock(2 * width, 4 * width, 2, norm),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.pool(self.layers(self.stem(x))).flatten(1))
