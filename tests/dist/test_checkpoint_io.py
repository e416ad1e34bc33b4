"""Checkpoint I/O at resume, with real processes (2 gloo ranks, torch.multiprocessing): rank 0 reads each file
once and the other ranks receive it; each rank gets back its own random streams; a file rank 0 cannot read
fails every rank with a message instead of leaving the others waiting."""

import builtins
import dataclasses
import datetime
import io
import json
import random
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

WORLD = 2


def _runtime(rank: int, store: Path):
    from hpctrain.dist.env import LaunchInfo
    from hpctrain.dist.runtime import Runtime

    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timeout)
    launch = LaunchInfo("torchrun", rank, rank, WORLD, WORLD, 0, 1, "127.0.0.1", 0, "localhost", "")
    return Runtime(**dataclasses.asdict(launch), device=torch.device("cpu"), backend="gloo",
                   control=dist.new_group(backend="gloo", timeout=timeout))


def _draws() -> list[float]:
    return [*torch.rand(3).tolist(), *np.random.rand(3).tolist(), random.random()]


def _spy_on_opens(root: Path, opened: list[str]) -> None:
    """Record every file under ``root`` this process opens (torch.load, read_bytes, read_text and hashing all
    open through builtins.open / io.open)."""
    real = builtins.open

    def spying_open(file, *args, **kwargs):
        if isinstance(file, (str, Path)) and str(Path(file).resolve()).startswith(str(root.resolve())):
            opened.append(Path(file).name)
        return real(file, *args, **kwargs)

    builtins.open = io.open = spying_open


FAULTS = ("", "train.pt", "rng.pt")
"""One restore per entry, in the same processes: none, then rank 0 failing to read that file."""


def _worker(rank: int, tmp: Path) -> None:
    from hpctrain.checkpoint import storage
    from hpctrain.checkpoint.manager import Checkpointer
    from hpctrain.dist.collectives import broadcast_bytes
    from hpctrain.errors import UserError, raised_on_every_rank
    from hpctrain.train.rng import capture_rng, restore_rng
    from hpctrain.train.state import TrainState
    from tests.unit.test_async_checkpoint import training_state

    reports: dict = {}
    real_open, real_read, real_load = builtins.open, storage.read_bytes, storage.load_file
    runtime = _runtime(rank, tmp / "store")
    try:
        stateful = training_state(3)
        ckpt = Checkpointer(tmp / "run", "toy", runtime, "", 3)
        torch.manual_seed(100 + rank)
        np.random.seed(200 + rank)
        random.seed(300 + rank)
        ckpt.save(TrainState(step=3, epoch=0, step_in_epoch=3, samples_seen=12).to_dict(), stateful,
                  capture_rng(runtime.device), wait=True)
        expected = _draws()  # each rank's streams right after the save
        payload = bytes(np.random.default_rng(1).integers(0, 256, 10_007, dtype=np.uint8))  # rank 0's only
        got = broadcast_bytes(payload if rank == 0 else None, len(payload), runtime, chunk_bytes=1_000)
        reports["chunks_equal"] = bytes(got) == payload
        for fault in FAULTS:
            report = reports[fault] = {}
            fresh = training_state(0)
            torch.manual_seed(7)
            np.random.seed(7)
            random.seed(7)
            if rank == 0 and fault == "train.pt":
                storage.read_bytes = lambda path, name: (
                    _raise(OSError(5, "Input/output error")) if name == "train.pt" else real_read(path, name))
            if rank == 0 and fault == "rng.pt":
                storage.load_file = lambda path, name: real_load(path / "gone" if name == "rng.pt" else path, name)
            opened: list[str] = []
            _spy_on_opens(tmp / "run" / "checkpoints", opened)
            try:
                resumed = ckpt.restore("auto", fresh)
                restore_rng(resumed.rng, runtime.device)  # what train/run.py does with them
            except UserError as err:
                report |= {"error": str(err), "on_every_rank": raised_on_every_rank(err)}
            else:
                live, loaded = stateful["model"].state_dict(), fresh["model"].state_dict()
                report |= {
                    "step": resumed.info["step"],
                    "rng_equal": _draws() == expected,
                    "model_equal": all(torch.equal(live[k], loaded[k]) for k in live),
                    "ema_equal": all(torch.equal(a, b) for a, b in zip(stateful["ema"].state_dict().values(),
                                                                         fresh["ema"].state_dict().values())),
                    "optim_equal": str(stateful["optimizer"].state_dict()) == str(fresh["optimizer"].state_dict()),
                }
            finally:
                builtins.open = io.open = real_open
                storage.read_bytes, storage.load_file = real_read, real_load
            report["opened"] = opened
    except BaseException:
        reports["crash"] = traceback.format_exc()
    finally:
        (tmp / f"rank{rank}.json").write_text(json.dumps(reports))
        dist.destroy_process_group()


def _raise(err: Exception):
    raise err


def _run(tmp: Path) -> list[dict]:
    ctx = mp.start_processes(_worker, args=(tmp,), nprocs=WORLD, join=False, start_method="spawn")
    try:
        for _ in range(180):
            if ctx.join(timeout=1):
                break
        else:
            pytest.fail("the 2 ranks did not finish within 180 s: a rank was left waiting")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    reports = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in reports:
        assert "crash" not in r, r["crash"]
    return reports


@pytest.fixture(scope="module")
def restores(tmp_path_factory) -> list[dict]:
    """Each rank's report of each restore in FAULTS (2 processes started once: a minute of imports here)."""
    return _run(tmp_path_factory.mktemp("restores"))


def test_broadcast_bytes_in_chunks_gives_every_rank_rank_0s_bytes(restores: list[dict]):
    assert [r["chunks_equal"] for r in restores] == [True, True]


def test_resume_reads_each_file_once_on_rank_0_and_restores_every_rank(restores: list[dict]):
    """Under ddp every rank holds the whole state: rank 0 reads the checkpoint once and broadcasts it."""
    main, other = (r[""] for r in restores)
    assert other["opened"] == [], "rank 1 read checkpoint files itself"
    # Rank 0: one read to verify each file's checksum, one to load it; nobody else. Rank 1's DCP file is empty
    # (replicated tensors are written by rank 0): verified, nothing in it to load.
    for name in ("__0_0.distcp", "train.pt", "rng.pt"):
        assert main["opened"].count(name) == 2, (name, main["opened"])
    # DCP's small index: once more, for the names of the parameters the optimizer holds state for.
    assert main["opened"].count(".metadata") == 3, main["opened"]
    assert main["opened"].count("__1_0.distcp") == 1, main["opened"]
    for rank, r in enumerate((main, other)):
        assert r["step"] == 3 and r["model_equal"] and r["ema_equal"] and r["optim_equal"], r
        assert r["rng_equal"], f"rank {rank} did not get its own random streams back"


@pytest.mark.parametrize("name", ["train.pt", "rng.pt"])
def test_a_file_rank_0_cannot_read_fails_every_rank_with_its_name(restores: list[dict], name: str):
    """Raised on both ranks (none left waiting: the same processes go on to the next restore), and marked as
    raised on every rank, so the ranks meet at teardown as after any shared verdict."""
    for r in restores:
        assert "error" in r[name], r[name]
        assert f"{name} from checkpoint" in r[name]["error"] and r[name]["on_every_rank"], r[name]["error"]
    assert restores[1][name]["opened"] == []
