"""The DDPM U-Net of Ho et al. (2020) for 32x32 images: 128 base channels, multipliers (1, 2, 2, 2),
two residual blocks per resolution, self-attention at 16x16, GroupNorm(32), sinusoidal time
embedding; about 35.7M parameters (the source blog's "~34M"). Written here because torchvision has
no diffusion U-Net and diffusers would be a large dependency for one module. ``in_channels`` and
``norm_groups`` (defaults 3 and 32, the paper's) let small variants run, e.g. on 1-channel 16x16 images."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / (half - 1))
    args = t.float()[:, None] * freqs[None]
    return torch.cat([args.sin(), args.cos()], dim=1)


def norm(channels: int, groups: int = 32) -> nn.GroupNorm:
    return nn.GroupNorm(groups, channels)


class ResBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, t_dim: int, dropout: float, groups: int = 32) -> None:
        super().__init__()
        self.norm1, self.conv1 = norm(c_in, groups), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.temb = nn.Linear(t_dim, c_out)
        self.norm2, self.drop, self.conv2 = norm(c_out, groups), nn.Dropout(dropout), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(F.silu(temb))[:, :, None, None]
        h = self.conv2(self.drop(F.silu(self.norm2(h))))
        return self.skip(x) + h


class Attention(nn.Module):
    def __init__(self, channels: int, groups: int = 32) -> None:
        super().__init__()
        self.norm, self.qkv, self.proj = norm(channels, groups), nn.Conv2d(channels, 3 * channels, 1), nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, h * w).transpose(-1, -2).unbind(1)
        out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        return x + self.proj(out.transpose(-1, -2).reshape(b, c, h, w))


class UNet(nn.Module):
    def __init__(self, ch: int = 128, ch_mult: tuple[int, ...] = (1, 2, 2, 2), num_res_blocks: int = 2,
                 attn_resolutions: tuple[int, ...] = (16,), dropout: float = 0.1, image_size: int = 32,
                 in_channels: int = 3, norm_groups: int = 32) -> None:
        super().__init__()
        self.ch, self.norm_groups, t_dim = ch, norm_groups, 4 * ch
        self.time = nn.Sequential(nn.Linear(ch, t_dim), nn.SiLU(), nn.Linear(t_dim, t_dim))
        self.stem = nn.Conv2d(in_channels, ch, 3, padding=1)
        self.down, skips, c, res = nn.ModuleList(), [ch], ch, image_size
        for level, mult in enumerate(ch_mult):
            for _ in range(num_res_blocks):
                self.down.append(self._block(c, ch * mult, t_dim, dropout, res in attn_resolutions))
                c = ch * mult
                skips.append(c)
            if level != len(ch_mult) - 1:
                self.down.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
                skips.append(c)
                res //= 2
        g = norm_groups
        self.mid = nn.ModuleList([ResBlock(c, c, t_dim, dropout, g), Attention(c, g), ResBlock(c, c, t_dim, dropout, g)])
        self.up = nn.ModuleList()
        for level, mult in reversed(list(enumerate(ch_mult))):
            for _ in range(num_res_blocks + 1):
                self.up.append(self._block(c + skips.pop(), ch * mult, t_dim, dropout, res in attn_resolutions))
                c = ch * mult
            if level != 0:
                self.up.append(nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(c, c, 3, padding=1)))
                res *= 2
        self.out = nn.Sequential(norm(c, g), nn.SiLU(), nn.Conv2d(c, in_channels, 3, padding=1))

    def _block(self, c_in: int, c_out: int, t_dim: int, dropout: float, attn: bool) -> nn.ModuleList:
        g = self.norm_groups
        return nn.ModuleList([ResBlock(c_in, c_out, t_dim, dropout, g)] + ([Attention(c_out, g)] if attn else []))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        temb = self.time(timestep_embedding(t, self.ch))
        h = self.stem(x)
        hs = [h]
        for layer in self.down:
            h = self._run(layer, h, temb)
            hs.append(h)
        for layer in self.mid:
            h = layer(h, temb) if isinstance(layer, ResBlock) else layer(h)
        for layer in self.up:
            h = self._run(layer, torch.cat([h, hs.pop()], dim=1), temb) if isinstance(layer, nn.ModuleList) else layer(h)
        return self.out(h)

    @staticmethod
    def _run(layer: nn.Module, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        if not isinstance(layer, nn.ModuleList):  # a downsampling conv
            return layer(h)
        h = layer[0](h, temb)
        return layer[1](h) if len(layer) > 1 else h
