"""The worker's error file for torchrun: torch's format, and never a partial file for the agent to choke on."""

import json
import os
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from hpctrain.fault.error_file import record_errors


def failing(message: str):
    @record_errors
    def worker():
        raise RuntimeError(message)

    return worker


def test_the_agent_reads_the_error_in_torchs_format(tmp_path: Path, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(RuntimeError):
        failing("injected crash on rank 1 at step 3")()
    failure = ProcessFailure(local_rank=1, pid=123, exitcode=1, error_file=str(error_file))
    assert failure.message["message"] == "RuntimeError: injected crash on rank 1 at step 3"
    assert "raise RuntimeError(message)" in failure.message["extraInfo"]["py_callstack"]
    assert failure.timestamp > 0
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]


def test_a_death_during_the_write_leaves_no_file_the_agent_cannot_parse(tmp_path: Path, monkeypatch):
    """The agent's SIGTERM arriving mid-write is simulated by the write itself ending the process's Python code."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    def killed(fd):
        raise SystemExit(143)

    monkeypatch.setattr(os, "fsync", killed)
    with pytest.raises(SystemExit):
        failing("peer went away")()
    assert list(tmp_path.iterdir()) == []  # no file at all: the agent reports the exit code alone
    ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(error_file))  # what raised JSONDecodeError in CI


def test_an_earlier_complete_error_survives_a_death_during_the_next_write(tmp_path: Path, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(RuntimeError):
        failing("first")()
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(SystemExit(143)))
    with pytest.raises(SystemExit):
        failing("second")()
    assert json.loads(error_file.read_text())["message"]["message"] == "RuntimeError: first"
