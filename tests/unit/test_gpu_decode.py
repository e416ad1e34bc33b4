"""The device-side decode path, run on the CPU (tests/gpu compares it on CUDA with the CPU)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from hpctrain.config.batch import batch_sizes
from hpctrain.config.schema import DataSection
from hpctrain.data.gpu_decode import FULL, Crop, collate_encoded, crop_resize_flip, decode_images, draw_crop, encoded_crop_flip
from hpctrain.data.loader import build_loader
from hpctrain.data.sampler import StepBatchSampler
from hpctrain.data.shards import write_split
from hpctrain.data.shardset import ShardDataset
from tests.unit.test_shard_loading import runtime


def _encoded(fmt: str, seed: int, size=(20, 30)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def test_decode_matches_pil_for_jpeg_and_png():
    datas = [_encoded("JPEG", 1), _encoded("PNG", 2), _encoded("JPEG", 3, (8, 8))]
    images = decode_images([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas], torch.device("cpu"))
    for data, image in zip(datas, images):
        reference = torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)
        assert image.shape == reference.shape and (image.int() - reference.int()).abs().float().mean() < 1.0


def test_crops_are_drawn_from_the_sample_generator_and_applied_exactly():
    a = draw_crop(torch.Generator().manual_seed(5))
    assert a == draw_crop(torch.Generator().manual_seed(5)) and 0.75 <= a.height <= 1.0
    image = torch.randint(0, 255, (3, 6, 6), dtype=torch.uint8)
    same = crop_resize_flip([image], [FULL], 6)
    assert torch.allclose(same[0], image.float() / 255)
    flipped = crop_resize_flip([image], [Crop(0, 0, 1, 1, True)], 6)
    assert torch.allclose(flipped[0], image.flip(-1).float() / 255)
    corner = crop_resize_flip([image], [Crop(0.5, 0.5, 0.5, 0.5, False)], 3)
    assert torch.allclose(corner[0], image[:, 3:, 3:].float() / 255)


def test_encoded_batches_through_workers_decode_like_the_cpu_path(tmp_path: Path):
    write_split(tmp_path, "train", ({"__key__": f"{i:04d}", "jpg": _encoded("JPEG", i), "cls": i % 3} for i in range(16)),
                1 << 20)
    raw = ShardDataset(tmp_path, ["jpg", "cls"], decode=False)
    decoded = ShardDataset(tmp_path, ["jpg", "cls"])
    plan = batch_sizes(8, 4, 1)
    sampler = StepBatchSampler(len(raw), plan, 0, seed=1, order=raw.epoch_order)
    cfg = DataSection(num_workers=1, worker_start="fork")
    loader = build_loader(raw, sampler, cfg, runtime(0, 1), collate_fn=collate_encoded, seed=1, transform=encoded_crop_flip)
    keys = [k for batch in sampler for k in batch]
    batches = list(loader)
    assert len(batches) == 4 and all(len(b.data) == 4 for b in batches)
    from hpctrain.data.seeding import sample_generator

    for b, batch in enumerate(batches):
        images = batch.decode(torch.device("cpu"), 12)
        assert images.shape == (4, 3, 12, 12)
        for j, key in enumerate(keys[4 * b : 4 * b + 4]):
            crop = draw_crop(sample_generator(1, key.epoch, key.index))
            expected = crop_resize_flip([decoded[key.index][0]], [crop], 12)[0]
            assert torch.equal(images[j], expected)
            assert int(batch.rest[0][j]) == key.index % 3
