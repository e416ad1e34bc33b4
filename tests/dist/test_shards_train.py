"""Training from shards with real torchrun processes: the same run for any world size and loader workers,
an exact resume after a world-size change, and unreadable samples (stop with a name, or counted skips)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.datasets import fixtures
from tests.conftest import read_jsonl, run_hpctrain

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

EXP = "shard_experiment:ShardClassifier"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cifar")
    fixtures.make_cifar10(root / "src", per_batch=20, test=20)  # 100 train, 20 test, in the official format
    assert main(["shard", str(root / "src"), str(root / "shards"), "--format", "cifar10", "--shard-size", "20KB"]) == 0
    return root / "shards"


def train(run_dir: Path, shards: Path, nproc: int, workers: int, *extra: str):
    args = ["train", EXP, f"model.shards={shards}", f"run.dir={run_dir}", f"data.num_workers={workers}",
            "data.shuffle_window=16", *extra]
    if nproc > 1:
        args[2:2] = ["--nproc-per-node", str(nproc)]
    return run_hpctrain(args, timeout=150)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "train"}


def test_world_size_workers_and_resume_do_not_change_the_run(tmp_path: Path, shards: Path):
    """The elastic run also reads a node-local staged copy (data.stage_dir): its 2 ranks stage it together, the
    resumed 3 ranks reuse it, as a requeued job on the same node does; the losses are the unstaged run's."""
    one = train(tmp_path / "one", shards, 1, 0)
    assert one.returncode == 0, one.output
    (tmp_path / "node").mkdir()
    staged = f"data.stage_dir={tmp_path / 'node'}"
    first = train(tmp_path / "elastic", shards, 2, 2, "train.stop_at_step=3", staged)
    assert first.returncode == 0, first.output
    copies = {p: p.stat().st_mtime_ns for p in (tmp_path / "node").rglob("*.tar")}
    assert len(copies) == len(list(shards.rglob("*.tar"))), "train and test staged"
    resumed = train(tmp_path / "elastic", shards, 3, 1, staged)  # 3 ranks x 1 worker, from 2 ranks x 2 workers
    assert resumed.returncode == 0, resumed.output
    assert "saved by 2 process(es)" in resumed.stderr
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "node").rglob("*.tar")} == copies, "reused, not copied"
    reference, elastic = losses(tmp_path / "one"), losses(tmp_path / "elastic")
    assert sorted(elastic) == sorted(reference) == list(range(1, 7))
    for step, loss in reference.items():
        assert elastic[step] == pytest.approx(loss, rel=1e-5), f"step {step}"


def _corrupt_one_image(shards: Path) -> str:
    """Overwrite the PNG bytes of the first training sample in place; returns its key."""
    index = json.loads((shards / "train" / "index.json").read_text())
    entry = index["shards"][0]
    offset, size = entry["members"]["png"][0]
    with open(shards / "train" / entry["name"], "r+b") as f:
        f.seek(offset)
        f.write(b"\x00" * size)
    return entry["keys"][0]


def test_unreadable_sample_stops_with_its_name_or_is_counted(tmp_path: Path, shards: Path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    key = _corrupt_one_image(broken)
    # Global batch 20 divides the 100 samples: no sample is dropped, so each epoch meets the bad one.
    batches = ("train.global_batch_size=20", "train.micro_batch_size=5", "train.max_steps=10")
    stop = train(tmp_path / "stop", broken, 2, 1, *batches)
    assert stop.returncode == 2, stop.output
    assert f"sample '{key}' of shard" in stop.stderr and "cannot decode .png (" in stop.stderr  # the decoder's words
    assert "failed first, exit code 2: DataError: sample" in stop.stderr  # the launcher's summary names it too
    # The failing rank shows a message, no traceback (the peer's "Connection closed by peer" is its consequence).
    assert "shardset.py" not in stop.stderr and "Original Traceback" not in stop.stderr
    skip = train(tmp_path / "skip", broken, 2, 1, *batches, "data.on_error=skip")
    assert skip.returncode == 0, skip.output
    assert "unreadable sample(s) skipped on all ranks (data.on_error=skip)" in skip.stderr
    records = [r for r in read_jsonl(tmp_path / "skip" / "metrics.jsonl") if r["split"] == "data"]
    assert [r["skipped_samples"] for r in records] == [1, 1], "one skip per epoch, reported at each epoch's end"


def test_shard_local_order_resumes_exactly_at_the_same_world_size(tmp_path: Path, shards: Path):
    """data.order=shard_local through torchrun: a run stopped mid-epoch and resumed on as many processes equals a
    straight one (loader workers do not matter); a switch of order mid-epoch is named in a warning."""
    straight = train(tmp_path / "straight", shards, 2, 0, "data.order=shard_local")
    assert straight.returncode == 0, straight.output
    assert "data.order=shard_local:" in straight.stderr and "dealt to 2 ranks" in straight.stderr
    first = train(tmp_path / "stopped", shards, 2, 1, "data.order=shard_local", "train.stop_at_step=2")
    assert first.returncode == 0, first.output
    resumed = train(tmp_path / "stopped", shards, 2, 2, "data.order=shard_local")
    assert resumed.returncode == 0, resumed.output
    assert "follows this run's order" not in resumed.stderr
    reference, stopped = losses(tmp_path / "straight"), losses(tmp_path / "stopped")
    assert sorted(stopped) == sorted(reference) == list(range(1, 7))
    for step, loss in reference.items():
        assert stopped[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    switched = train(tmp_path / "stopped2", shards, 2, 0, "train.stop_at_step=2")
    assert switched.returncode == 0, switched.output
    exact = losses(tmp_path / "stopped2")
    assert all(exact[k] != pytest.approx(reference[k], rel=1e-5) for k in (1, 2)), "training took the shard-local order"
    back = train(tmp_path / "stopped2", shards, 2, 0, "data.order=shard_local")
    assert back.returncode == 0, back.output
    assert "written with data.order=exact, this run has data.order=shard_local" in back.stderr
