"""A metrics line that cannot be written (full disk, quota) is the user's to fix: a message and exit 2 through
UserError, not an OSError traceback (with async checkpoints it can be the first write to hit a full disk)."""

from pathlib import Path

import pytest

from hpctrain.errors import UserError
from hpctrain.metrics.sinks import JsonlSink
from tests.conftest import tmpfs


@pytest.fixture
def tiny_disk(tmp_path: Path):
    with tmpfs(tmp_path / "disk", "8k") as mount:
        yield mount


def test_a_full_disk_under_the_metrics_file_is_a_user_error_that_names_it(tiny_disk: Path):
    sink = JsonlSink(tiny_disk / "metrics.jsonl")
    with pytest.raises(UserError, match="cannot write .*metrics.jsonl.*No space left on device") as err:
        for step in range(10_000):  # 8 KiB hold about 60 of these lines
            sink.write({"step": step, "loss": 1.0, "note": "x" * 100})
    assert "last checkpoint is intact" in err.value.hint
    sink.close()  # the unwritten rest of the buffer does not raise again
