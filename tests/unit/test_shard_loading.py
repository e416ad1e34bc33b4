"""The distributed guarantees of sharded training data, with real loader worker processes.

Each rank's loader is built as training builds it (sampler + build_loader), for 1, 2 and 3
ranks and 0, 1 and 2 workers; the ranks of one world run one after another in this process,
since the data layer depends on the rank number only, not on a process group. Workers start by
fork here (quicker, and this process has no threads); tests/dist trains from shards with the
default forkserver."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from hpctrain.config.batch import batch_sizes
from hpctrain.config.schema import DataSection
from hpctrain.data.loader import build_loader
from hpctrain.data.sampler import StepBatchSampler
from hpctrain.data.shards import write_split
from hpctrain.data.shardset import DataError, ShardDataset
from hpctrain.dist.runtime import Runtime

GLOBAL, MICRO, SEED = 12, 2, 7


def runtime(rank: int, world: int) -> Runtime:
    return Runtime(rank=rank, world_size=world, local_rank=rank, local_world_size=world, node_rank=0, num_nodes=1,
                   master_addr="127.0.0.1", master_port=0, hostname="test", job_id="", launcher="single",
                   device=torch.device("cpu"), backend="")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """4 shards of uneven size (15, 15, 15, 5 samples); cls = the sample's global number."""
    root = tmp_path_factory.mktemp("shards")
    samples = ({"__key__": f"{i:05d}", "cls": i, "txt": f"sample {i}"} for i in range(50))
    write_split(root, "train", samples, max_bytes=15 * 2 * 1024 + 100)
    return root


def steps_seen(root: Path, world: int, workers: int, epoch: int = 0, start: int = 0, **data) -> list[list[int]]:
    """Per optimizer step, the sorted global sample numbers all ranks consumed."""
    cfg = DataSection(num_workers=workers, worker_start="fork" if workers else "forkserver", **data)
    plan = batch_sizes(GLOBAL, MICRO, world)
    per_step: dict[int, list[int]] = {}
    counts = []
    for rank in range(world):
        ds = ShardDataset(root, ["cls"], window=8)
        sampler = StepBatchSampler(len(ds), plan, rank, SEED, order=ds.epoch_order)
        sampler.set_position(epoch, start)
        loader = build_loader(ds, sampler, cfg, runtime(rank, world), collate_fn=lambda b: [s[0] for s in b], seed=SEED)
        batches = list(loader)
        counts.append(len(batches))
        for b, batch in enumerate(batches):
            per_step.setdefault(start + b // plan.grad_accum, []).extend(batch)
    assert len(set(counts)) == 1, f"ranks got different numbers of batches: {counts}"
    return [sorted(per_step[k]) for k in sorted(per_step)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_every_step_has_the_same_samples_for_any_ranks_and_workers(shards: Path, world: int, workers: int):
    reference = steps_seen(shards, 1, 0)
    assert len(reference) == 50 // GLOBAL  # 4 full steps; the partial last batch is dropped on every rank alike
    assert steps_seen(shards, world, workers) == reference
    assert steps_seen(shards, world, workers, epoch=1) != reference, "each epoch has its own order"


@pytest.mark.parametrize("world,resume_world", [(2, 3), (3, 1), (1, 2)])
def test_mid_epoch_resume_continues_the_same_stream_after_a_world_size_change(shards: Path, world, resume_world):
    full = steps_seen(shards, world, 1)
    assert steps_seen(shards, resume_world, 2, start=2) == full[2:]


def test_fewer_shards_than_ranks_times_workers(tmp_path: Path):
    write_split(tmp_path, "one", ({"__key__": f"{i:05d}", "cls": i} for i in range(36)), max_bytes=1 << 20)
    assert len(list(tmp_path.glob("*.tar"))) == 1
    assert steps_seen(tmp_path, 3, 2) == steps_seen(tmp_path, 1, 0), "1 shard, 3 ranks x 2 workers: no rank starves"


def test_unreadable_samples_stop_with_their_name_or_are_counted(tmp_path: Path):
    def samples():
        for i in range(24):
            yield {"__key__": f"{i:05d}", "cls": i if i != 5 else 99}

    write_split(tmp_path, "bad", samples(), max_bytes=1 << 20)

    def loader(on_error: str, workers: int):
        ds = ShardDataset(tmp_path, ["cls"], num_classes=30)
        plan = batch_sizes(GLOBAL, MICRO, 1)
        sampler = StepBatchSampler(len(ds), plan, 0, SEED, order=ds.epoch_order)
        cfg = DataSection(num_workers=workers, worker_start="fork", on_error=on_error)
        return build_loader(ds, sampler, cfg, runtime(0, 1), collate_fn=lambda b: [s[0] for s in b], seed=SEED)

    for workers in (0, 1):
        with pytest.raises(DataError, match=r"sample '00005' of shard .*: label 99 outside the 30 classes") as err:
            list(loader("raise", workers))
        assert "Traceback" not in str(err.value), "a worker's error reaches the user as its message, not a traceback"
        counting = loader("skip", workers)
        seen = [s for batch in counting for s in batch]
        assert len(seen) == 23 and 5 not in seen
        skipped = counting.take_skipped()
        assert len(skipped) == 1 and "sample '00005'" in skipped[0] and counting.take_skipped() == []


def test_block_reads_open_each_shard_once_and_read_large_blocks(shards: Path):
    ds = ShardDataset(shards, ["cls"], window=8, block_bytes=64 * 1024)
    for i in ds.epoch_order(SEED, 0).tolist():
        ds[i]
    assert ds.reader.opened == 4
    assert ds.reader.reads == 4, "each (small) shard is read in one block, not a read per sample"
    fresh = pickle.loads(pickle.dumps(ds))  # into a worker: without the open files and cached blocks
    assert fresh._reader is None and fresh[3] == (3,)
