"""The digits set read from scikit-learn's file equals scikit-learn's own loader, without importing scikit-learn."""

import subprocess
import sys

import torch

from hpctrain.experiments.digits.data import digits_file, load_digits_tensors


def test_the_file_read_directly_equals_scikit_learns_loader():
    from sklearn.datasets import load_digits

    images, labels = load_digits_tensors()
    bunch = load_digits()
    assert digits_file().is_file()
    assert images.shape == (1797, 1, 8, 8) and images.dtype == torch.float32
    assert torch.equal(images, torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0)
    assert torch.equal(labels, torch.tensor(bunch.target, dtype=torch.long))


def test_loading_does_not_import_scikit_learn():
    code = ("import sys; from hpctrain.experiments.digits.data import load_digits_tensors; load_digits_tensors(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
