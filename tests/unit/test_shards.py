"""Shard format: webdataset compatibility both ways, index, manifest, atomic writes, bad shards."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds  # a dev dependency: missing, the tests fail rather than skip
from PIL import Image

from hpctrain.data.shards import (INDEX, MANIFEST, index_directory, index_tar, split_member_name,
                                  write_split)
from hpctrain.data.shardset import DataError, ShardDataset, load_index, shard_epoch_order
from hpctrain.errors import UserError
from hpctrain.units import parse_size



def _png(value: int, size: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size, size, 3), value % 256, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _jpg(value: int, size: int = 16) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size, size, 3), value % 256, dtype=np.uint8)).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _samples(n: int):
    for i in range(n):
        yield {"__key__": f"{i:06d}", "png": _png(i), "cls": i % 10, "json": {"i": i}}


def test_parse_size_and_member_names():
    assert parse_size("1GB") == 10**9 and parse_size("64MiB") == 64 << 20 and parse_size("1000") == 1000
    assert parse_size("2.5 MB") == 2_500_000 and parse_size("1kb") == 1000
    with pytest.raises(UserError, match="cannot read the size"):
        parse_size("big")
    assert split_member_name("a/b/000123.seg.png") == ("a/b/000123", "seg.png")
    assert split_member_name("000123.JPG") == ("000123", "jpg")
    assert split_member_name("README") == ("", "")


def test_hpctrain_shards_read_by_webdataset(tmp_path: Path):
    n = write_split(tmp_path, "train", _samples(25), max_bytes=20_000)
    tars = sorted(str(p) for p in tmp_path.glob("*.tar"))
    assert n == 25 and len(tars) > 1, "small max_bytes must roll over to several shards"
    got = list(wds.WebDataset(tars, shardshuffle=False, empty_check=False).decode("rgb8"))
    assert [s["__key__"] for s in got] == [f"{i:06d}" for i in range(25)]
    assert [int(s["cls"]) for s in got] == [i % 10 for i in range(25)]
    assert all(int(s["png"][0, 0, 0]) == i for i, s in enumerate(got))
    assert got[3]["json"] == {"i": 3}
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["samples"] == 25 and len(manifest["shards"]) == len(tars)
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])


def test_webdataset_shards_read_by_hpctrain(tmp_path: Path):
    with wds.ShardWriter(str(tmp_path / "wds-%06d.tar"), maxcount=7) as sink:
        for i in range(20):
            sink.write({"__key__": f"s{i:04d}", "jpg": _jpg(10 * i), "cls": str(i % 3).encode()})
    with pytest.raises(UserError, match="--index-only"):
        ShardDataset(tmp_path, ["jpg", "cls"])
    assert index_directory(tmp_path) == 20
    ds = ShardDataset(tmp_path, ["jpg", "cls"], num_classes=3)
    assert len(ds) == 20 and ds.sizes == [7, 7, 6]
    for i in (0, 8, 19):
        image, label = ds[i]
        assert image.shape == (3, 16, 16) and label == i % 3
        assert abs(int(image.float().mean()) - 10 * i) <= 2  # JPEG is lossy
    assert ds.reader.opened == 3  # one open per shard, however many samples


def test_writes_are_deterministic_and_atomic(tmp_path: Path):
    write_split(tmp_path / "a", "train", _samples(12), 20_000)
    write_split(tmp_path / "b", "train", _samples(12), 20_000)
    digests = [[s["sha256"] for s in json.loads((tmp_path / d / MANIFEST).read_text())["shards"]] for d in "ab"]
    assert digests[0] == digests[1], "same input must give byte-identical shards"

    def failing():
        yield from _samples(9)
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError):
        write_split(tmp_path / "c", "train", failing(), 20_000)
    assert not (tmp_path / "c" / MANIFEST).exists(), "an interrupted split must not look complete"
    assert not list((tmp_path / "c").glob(".*.tmp")), "the shard in progress must be removed"
    with pytest.raises(UserError, match="incomplete"):
        load_index(tmp_path / "c")


def test_truncated_and_corrupt_shards(tmp_path: Path):
    write_split(tmp_path, "train", _samples(6), 1_000_000)
    tar = tmp_path / "train-000000.tar"
    ds = ShardDataset(tmp_path, ["png", "cls"], num_classes=10)
    data = tar.read_bytes()
    tar.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="not a readable tar"):
        index_tar(tar)
    with pytest.raises(UserError, match=r"train-000000.tar has \d+ bytes, the manifest says \d+: it is truncated"):
        ShardDataset(tmp_path, ["png", "cls"])
    with pytest.raises(DataError, match="truncated"):  # a dataset opened before the file was cut
        ds[5]


def test_bad_samples_name_shard_and_key(tmp_path: Path):
    def samples():
        yield {"__key__": "000000", "png": _png(1), "cls": 1}
        yield {"__key__": "000001", "png": b"\x89PNG\r\n\x1a\n garbage", "cls": 2}
        yield {"__key__": "000002", "png": _png(3), "cls": 42}
        yield {"__key__": "000003", "jpg": _jpg(4), "cls": 3}

    write_split(tmp_path, "train", samples(), 1_000_000)
    ds = ShardDataset(tmp_path, ["png", "cls"], num_classes=10)
    assert ds[0][1] == 1
    with pytest.raises(DataError, match=r"sample '000001' of shard .*train-000000.tar: cannot decode .png"):
        ds[1]
    with pytest.raises(DataError, match="label 42 outside the 10 classes"):
        ds[2]
    with pytest.raises(DataError, match=r"sample '000003' .* has no .png member"):
        ds[3]
    assert ShardDataset(tmp_path, ["jpg;png", "cls"])[3][0].shape == (3, 16, 16), "alternatives: first present wins"


def test_missing_or_empty_shard_sets(tmp_path: Path):
    with pytest.raises(UserError, match="does not exist"):
        ShardDataset(tmp_path / "nope", ["png"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no shards"):
        ShardDataset(tmp_path / "empty", ["png"])
    with pytest.raises(UserError, match="no .tar shards"):
        index_directory(tmp_path / "empty")
    (tmp_path / "empty" / INDEX).write_text('{"shards": []}')
    (tmp_path / "empty" / MANIFEST).write_text("{}")
    with pytest.raises(UserError, match="lists no shards"):
        ShardDataset(tmp_path / "empty", ["png"])


def test_epoch_order_is_a_local_permutation_from_seed_and_epoch():
    sizes = [50, 30, 70, 10]
    order = shard_epoch_order(sizes, seed=1, epoch=0, window=20)
    assert sorted(order.tolist()) == list(range(160))
    assert torch.equal(order, shard_epoch_order(sizes, 1, 0, 20))
    assert not torch.equal(order, shard_epoch_order(sizes, 1, 1, 20))
    assert not torch.equal(order, shard_epoch_order(sizes, 2, 0, 20))
    # Locality: every 20 consecutive samples of the order come from at most 2 windows (<= 40 consecutive
    # positions) of the epoch's shard stream.
    stream = shard_epoch_order(sizes, 1, 0, window=1)
    position = {int(s): i for i, s in enumerate(stream)}
    for start in range(0, 160, 20):
        spots = [position[int(s)] for s in order[start : start + 20]]
        assert max(spots) - min(spots) < 40
    assert torch.equal(shard_epoch_order(sizes, 1, 0, 20, shuffle=False), torch.arange(160))
    assert sorted(shard_epoch_order(sizes, 1, 0, window=1000).tolist()) == list(range(160))
