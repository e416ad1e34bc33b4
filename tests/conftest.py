"""Shared fixtures: a CLI runner with a hard timeout that kills the whole process tree,
and a check that no test leaks a process group or environment variables."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# One intra-op thread in every process of the suite (the pytest workers and every run they launch; torchrun sets the
# same for several ranks), unless the developer set their own: two pytest workers already keep both cores of a CI VM
# busy, and OpenMP's threads spin-waiting for a descheduled sibling made in-process steps 10-20x slower under load
# (tests/unit/test_step_modes.py: 2.6 s alone, 29-61 s in the suite). Set before torch is imported (OpenMP reads it
# when it loads).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from hpctrain.proctree import descendants, kill_tree  # noqa: E402, F401 (descendants: imported by tests)

TESTS = Path(__file__).resolve().parent


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_hpctrain(args: list[str], timeout: float = 120, cwd: Path | None = None, env: dict | None = None) -> Result:
    """Run `python -m hpctrain ARGS` in its own session; on timeout kill the session and fail (run_module)."""
    return run_module("hpctrain", args, timeout, cwd, env)


def run_module(module: str, args: list[str], timeout: float = 120, cwd: Path | None = None,
               env: dict | None = None) -> Result:
    """Run `python -m MODULE ARGS` in its own session; on timeout kill the session and fail.

    torchrun and its workers run in a session of their own (see dist/parent_death.py) and die
    with their parent (PR_SET_PDEATHSIG), so killing ours takes the whole tree down."""
    # TESTS first (user experiments such as shard_experiment), then the caller's own path: a worktree on
    # PYTHONPATH must reach the subprocess, or it tests the editable install's tree instead.
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("RANK", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"{module} {' '.join(args)} hung for {timeout} s (hard timeout)\n{out}\n{err}")
    return Result(proc.returncode, out, err)


def checkpoint_tensors(checkpoint: Path, part: str = "model") -> dict:
    """One part (model, optim, ema) of a checkpoint's DCP tensors by name, read with torch's own converter
    (dcp_to_torch_save), not hpctrain's loading code: what a test compares is then independent of it."""
    import tempfile
    import warnings

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp_to_torch_save(checkpoint / "dcp", Path(tmp) / "all.pt")
        everything = torch.load(Path(tmp) / "all.pt", weights_only=True)
    if part in everything:  # nested, as saved
        return everything[part]
    prefix = part + "."
    return {k[len(prefix):]: v for k, v in everything.items() if k.startswith(prefix)}


def write_dcp_checkpoint(root: Path, step: int, parts: dict, files: dict, meta: dict) -> Path:
    """A complete checkpoint in hpctrain's format written by hand (one process): ``parts`` (e.g. {"model": state
    dict, "ema": state dict}) through torch.distributed.checkpoint, ``files`` (state.json, ...) beside them, the
    manifest listing all of it. For tests of what reads checkpoints, without a training run."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from hpctrain.checkpoint import storage

    tmp = storage.new_temporary(root, step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(parts, checkpoint_id=str(tmp / "dcp"), no_dist=True)
    entries = {f"dcp/{f.name}": storage.hash_file(f) for f in (tmp / "dcp").iterdir()}
    entries |= storage.write_files(tmp, files)
    return storage.finish_checkpoint(root, tmp, step, entries, {"parts": sorted(parts), **meta})


@contextlib.contextmanager
def tmpfs(mount: Path, size: str):
    """A tmpfs of ``size`` (e.g. "1800k") mounted at ``mount`` for the block, unmounted after it even when the test
    fails; the test is skipped where mounting is not allowed (not root, no tmpfs)."""
    mount.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def latest_checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()


def final_params(run_dir: Path) -> dict:
    return checkpoint_tensors(latest_checkpoint(run_dir))


def same_params(a: dict, b: dict) -> bool:
    """The same names, and each tensor equal bit for bit (non-tensor entries, such as an optimizer's flattened
    hyperparameters, equal)."""
    import torch

    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "train"}


@pytest.fixture(autouse=True)
def _no_leaks():
    """Fail a test that leaves torch.distributed initialised or changes launch variables."""
    watched = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    before = {k: os.environ.get(k) for k in watched}
    yield
    after = {k: os.environ.get(k) for k in watched}
    assert before == after, f"test leaked environment variables: {before} -> {after}"
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test left a process group initialised")


@contextlib.contextmanager
def benchmark_module(name: str, folder: str = "benchmarks"):
    """FOLDER/NAME.py imported as a module NAME's last part (benchmarks/ and tools/ are not packages; NAME may be
    a path under FOLDER, e.g. archive/2026-11/vote), registered in sys.modules while in use: dataclasses look their
    module up there."""
    path = Path(__file__).resolve().parents[1] / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(path.stem, None)


def tool_module(name: str):
    """tools/NAME.py imported as a module, as benchmark_module does for benchmarks/."""
    return benchmark_module(name, folder="tools")

