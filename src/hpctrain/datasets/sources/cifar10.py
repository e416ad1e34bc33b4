"""CIFAR-10 in its official python layout: ``cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}``.

Each batch is a pickled dict: ``b"data"`` (10000 x 3072 uint8, the red plane, then green,
then blue, each row-major 32x32), ``b"labels"`` (10000 ints 0..9), ``b"filenames"``.
Read here directly (a dozen lines) rather than through torchvision's CIFAR10 class, which
refuses any file whose MD5 is not the official one, and so any test fixture.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from hpctrain.errors import UserError

URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MD5 = "c58f30108f718f92721af3b95e74349a"
FOLDER = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCHES = ("test_batch",)
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def batches_dir(root: Path) -> Path:
    """Accept the folder itself or the directory that holds it."""
    return root if root.name == FOLDER or (root / "data_batch_1").exists() else root / FOLDER


def download(root: Path) -> Path:
    """The official archive (163 MB, MD5-checked), via torchvision's downloader."""
    from torchvision.datasets.utils import download_and_extract_archive

    try:
        download_and_extract_archive(URL, str(root), md5=MD5)
    except Exception as err:  # URLError, socket errors, MD5 mismatch
        raise UserError(
            f"cannot download CIFAR-10 from {URL}: {err}",
            f"on a machine with internet access download and unpack {URL} and copy '{FOLDER}' to {root}.",
        ) from None
    return root / FOLDER


def load_batch(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = pickle.load(f, encoding="bytes")
        data = np.asarray(raw[b"data"], dtype=np.uint8)
        labels = np.asarray(raw[b"labels"], dtype=np.int64)
    except FileNotFoundError:
        raise UserError(f"CIFAR-10 batch {path} is missing",
                        f"download CIFAR-10 (hpctrain shard ... --download, or unpack {URL}).") from None
    except Exception as err:
        raise UserError(f"{path} is not a CIFAR-10 python batch ({type(err).__name__}: {err})",
                        "the file is corrupt or of another format: download it again.") from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise UserError(f"{path}: expected N x 3072 pixels and N labels, found {data.shape} and {len(labels)}",
                        "the file is not CIFAR-10 (CIFAR-100 uses b'fine_labels'); download CIFAR-10 again.")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise UserError(f"{path}: labels outside 0..9", "the file is not CIFAR-10; download it again.")
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in raw.get(b"filenames", [])]
    return {"images": data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), "labels": labels, "filenames": names}


def check_present(root: Path, download_if_missing: bool) -> Path:
    folder = batches_dir(root)
    if not (folder / "data_batch_1").exists():
        if download_if_missing:
            return download(root)
        raise UserError(
            f"CIFAR-10 not found under {root} (expected {folder}/data_batch_1 ... test_batch)",
            f"add --download to fetch it (needs internet), or unpack {URL} there.",
        )
    return folder


def samples(root: Path, split: str) -> Iterator[tuple[np.ndarray, int, dict[str, Any]]]:
    """(HxWx3 uint8 image, label, metadata) of the 'train' (50,000) or 'test' (10,000) split, in file order."""
    folder = batches_dir(root)
    for name in TRAIN_BATCHES if split == "train" else TEST_BATCHES:
        batch = load_batch(folder / name)
        for i, (image, label) in enumerate(zip(batch["images"], batch["labels"])):
            meta = {"batch": name, "row": i}
            if batch["filenames"]:
                meta["filename"] = batch["filenames"][i]
            yield image, int(label), meta
