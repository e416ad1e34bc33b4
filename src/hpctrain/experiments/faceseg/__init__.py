"""Face parsing on CelebAMask-HQ with DeepLabV3+."""
