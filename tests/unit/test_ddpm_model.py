import pytest
import torch

from hpctrain.experiments.ddpm.model import UNet

# The small configuration for 1-channel 16x16 images (about 1.1M parameters); 8x8 drops the last level.
SMALL = dict(ch=32, ch_mult=(1, 2, 2), num_res_blocks=1, attn_resolutions=(8,), norm_groups=8, in_channels=1)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_ddpm_unet_has_the_papers_size_and_maps_images_to_noise_of_the_same_shape():
    model = UNet()
    n = n_params(model)
    assert 35e6 < n < 37e6 and n == 35_746_307, f"{n} parameters; Ho et al.: 35.7M for CIFAR-10"
    small = UNet(ch=32, ch_mult=(1, 2), num_res_blocks=1, image_size=16, attn_resolutions=(8,))
    x = torch.randn(2, 3, 16, 16)
    out = small(x, torch.tensor([0, 999]))
    assert out.shape == x.shape
    out.square().mean().backward()
    assert all(p.grad is not None for p in small.parameters())


@pytest.mark.parametrize("size, ch_mult, expected", [(16, (1, 2, 2), 1_112_801), (8, (1, 2), 663_905)])
def test_small_single_channel_unet(size, ch_mult, expected):
    model = UNet(**{**SMALL, "ch_mult": ch_mult}, image_size=size)
    assert n_params(model) == expected
    x = torch.randn(2, 1, size, size)
    assert model(x, torch.tensor([0, 999])).shape == x.shape
