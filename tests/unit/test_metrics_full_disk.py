"""A metrics line that cannot be written (full disk, quota) is the user's to fix: a message and exit 2 through
UserError, not an OSError traceback (with async checkpoints it can be the first write to hit a full disk)."""

import os
import subprocess
from pathlib import Path

import pytest

from hpctrain.errors import UserError
from hpctrain.metrics.sinks import JsonlSink


@pytest.fixture
def tiny_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_under_the_metrics_file_is_a_user_error_that_names_it(tiny_disk: Path):
    sink = JsonlSink(tiny_disk / "metrics.jsonl")
    with pytest.raises(UserError, match="cannot write .*metrics.jsonl.*No space left on device") as err:
        for step in range(10_000):  # 8 KiB hold about 60 of these lines
            sink.write({"step": step, "loss": 1.0, "note": "x" * 100})
    assert "last checkpoint is intact" in err.value.hint
    sink.close()  # the unwritten rest of the buffer does not raise again
