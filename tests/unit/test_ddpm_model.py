import torch

from hpctrain.experiments.ddpm.model import UNet


def test_ddpm_unet_has_the_papers_size_and_maps_images_to_noise_of_the_same_shape():
    model = UNet()
    assert 35.5e6 < sum(p.numel() for p in model.parameters()) < 36.0e6  # Ho et al.: 35.7M for CIFAR-10
    small = UNet(ch=32, ch_mult=(1, 2), num_res_blocks=1, image_size=16, attn_resolutions=(8,))
    x = torch.randn(2, 3, 16, 16)
    out = small(x, torch.tensor([0, 999]))
    assert out.shape == x.shape
    out.square().mean().backward()
    assert all(p.grad is not None for p in small.parameters())
