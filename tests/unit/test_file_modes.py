"""Files a run writes are readable by whoever the umask lets read them: on a shared file system teammates resume,
evaluate and use exports. mkstemp (and safetensors) create 0o600 files, which a rename into place would keep."""

import os
import stat
from pathlib import Path

import pytest
import torch

from hpctrain.atomic import atomic_write_text, new_file_mode
from hpctrain.export import write_export, write_weights_file


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_atomic_writes_end_with_the_mode_the_umask_gives(tmp_path: Path, umask: int):
    expected = 0o666 & ~umask
    assert new_file_mode() == expected
    atomic_write_text(tmp_path / "config.toml", "x = 1\n")
    atomic_write_text(tmp_path / "config.toml", "x = 2\n")  # replacing keeps it too
    plain = tmp_path / "plain"
    plain.write_text("")  # what open() gives under this umask
    assert mode(tmp_path / "config.toml") == mode(plain) == expected


def test_exported_weights_and_configs_are_readable_by_the_group(tmp_path: Path, umask: int):
    tensors = {"w": torch.zeros(2)}
    written = write_export(tmp_path / "export", tensors, {"k": "v"}, b"x = 1\n", "card", None)
    written += write_weights_file(tmp_path / "model.safetensors", tensors, {"k": "v"}, b"x = 1\n")
    assert written and all(mode(p) == 0o666 & ~umask for p in written), {p.name: oct(mode(p)) for p in written}
