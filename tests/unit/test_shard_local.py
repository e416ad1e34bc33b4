"""data.order=shard_local: each rank reads its own shards, equal step counts, every sample once per epoch, exact
resume at a fixed world size; and the warnings of a resume that changes what the order depends on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpctrain.config.batch import batch_sizes
from hpctrain.config.schema import DataSection
from hpctrain.data.loader import build_loader
from hpctrain.data.sampler import StepBatchSampler
from hpctrain.data.shard_local import RankLayout, data_order_warning, deal_shards, shard_local_order, shard_local_summary
from hpctrain.data.shards import write_split
from hpctrain.data.shardset import ShardDataset
from tests.unit.test_shard_loading import runtime

SEED = 3


def owner_of(sizes: list[int]) -> list[int]:
    """Sample -> its shard."""
    return [s for s, n in enumerate(sizes) for _ in range(n)]


@pytest.mark.parametrize("sizes,world,per_rank", [
    ([10] * 8, 2, 4), ([10] * 8, 4, 3), ([10] * 9, 4, 2), ([13, 7, 10, 10, 4, 16], 3, 5), ([50], 3, 4), ([3, 3], 4, 1),
])
def test_every_sample_once_per_epoch_and_equal_steps(sizes, world, per_rank):
    total, g = sum(sizes), world * per_rank
    for epoch in (0, 1):
        order = shard_local_order(sizes, SEED, epoch, 6, RankLayout(world, per_rank))
        assert sorted(order.tolist()) == list(range(total)), "a permutation of the epoch's samples"
        read = order[: total // g * g]  # the partial last global batch is dropped, as in the exact order
        assert len(set(read.tolist())) == total // g * g
        assert len(order) - len(read) < g


@pytest.mark.parametrize("sizes,world,per_rank", [([10] * 8, 2, 4), ([10] * 8, 4, 5), ([10] * 9, 4, 2),
                                                  ([13, 7, 10, 10, 4, 16], 3, 5)])
def test_a_rank_reads_its_own_shards_but_for_the_equalising_samples(sizes, world, per_rank):
    shard = owner_of(sizes)
    layout = RankLayout(world, per_rank)
    for epoch in (0, 1, 2):
        order = shard_local_order(sizes, SEED, epoch, 6, layout)
        steps = sum(sizes) // (world * per_rank)
        per_step = order[: steps * world * per_rank].reshape(steps, world, per_rank)
        owned = {r: set(s) for r, s in enumerate(deal_shards(sizes, world, _epoch_generator(epoch)))}
        for r in range(world):
            mine = per_step[:, r].reshape(-1).tolist()
            foreign = [i for i in mine if shard[i] not in owned[r]]
            assert len(foreign) <= max(sizes), f"rank {r} reads {len(foreign)} samples of others' shards"
            assert mine[len(mine) - len(foreign):] == foreign, "borrowed samples come at the end of the epoch"
        if len(set(sizes)) == 1 and len(sizes) % world == 0 and (sizes[0] * len(sizes) // world) % per_rank == 0:
            assert all(shard[i] in owned[r] for r in range(world) for i in per_step[:, r].reshape(-1).tolist()), \
                "equal shards, equal shares: no rank borrows"


def _epoch_generator(epoch: int) -> torch.Generator:
    from hpctrain.data.seeding import SALT_SHARD_LOCAL, generator
    from hpctrain.data.shard_local import DEAL

    return generator(SALT_SHARD_LOCAL, DEAL, SEED, epoch)


def test_shards_are_dealt_anew_each_epoch_and_the_order_is_a_function_of_its_inputs():
    sizes, layout = [10] * 8, RankLayout(2, 4)
    a = shard_local_order(sizes, SEED, 0, 6, layout)
    assert torch.equal(a, shard_local_order(sizes, SEED, 0, 6, layout))
    assert not torch.equal(a, shard_local_order(sizes, SEED, 1, 6, layout))
    assert not torch.equal(a, shard_local_order(sizes, SEED + 1, 0, 6, layout))
    assert not torch.equal(a, shard_local_order(sizes, SEED, 0, 6, RankLayout(4, 2))), "depends on the world size"
    deals = {tuple(map(tuple, deal_shards(sizes, 2, _epoch_generator(e)))) for e in range(6)}
    assert len(deals) > 1, "a rank does not keep the same shards every epoch"
    plain = shard_local_order(sizes, SEED, 0, 6, layout, shuffle=False)
    assert plain[:4].tolist() == [0, 1, 2, 3] and plain[4:8].tolist() == [10, 11, 12, 13], "no shuffle: shards dealt in turn"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """8 shards of 9 samples and one of 6 (78); cls = the sample's global number."""
    root = tmp_path_factory.mktemp("shards")
    write_split(root, "train", ({"__key__": f"{i:05d}", "cls": i} for i in range(78)), max_bytes=9 * 2 * 1024 + 100)
    return root


def rank_batches(root: Path, world: int, rank: int, workers: int, epoch: int = 0, start: int = 0):
    """One rank's loader as training builds it with data.order=shard_local: its batches, and the shards it opened."""
    cfg = DataSection(num_workers=workers, worker_start="fork", order="shard_local")
    plan = batch_sizes(12, 2, world)
    ds = ShardDataset(root, ["cls"], window=8)
    layout = RankLayout(world, plan.per_rank)
    sampler = StepBatchSampler(len(ds), plan, rank, SEED, order=lambda s, e, sh: ds.epoch_order(s, e, sh, layout=layout))
    sampler.set_position(epoch, start)
    loader = build_loader(ds, sampler, cfg, runtime(rank, world), collate_fn=lambda b: [s[0] for s in b], seed=SEED)
    return [batch for batch in loader], ds


@pytest.mark.parametrize("world,workers", [(2, 0), (3, 2)])
def test_ranks_of_a_real_loader_cover_the_epoch_once_with_equal_batch_counts(shards: Path, world, workers):
    total = 78 // 12 * 12
    for epoch in (0, 1):
        per_rank = [rank_batches(shards, world, r, workers, epoch)[0] for r in range(world)]
        assert len({len(b) for b in per_rank}) == 1, "no rank waits for the others at the end of the epoch"
        seen = [s for batches in per_rank for b in batches for s in b]
        assert len(seen) == len(set(seen)) == total


def test_a_rank_opens_only_its_own_shards(shards: Path):
    sizes = ShardDataset(shards, ["cls"]).sizes
    owned = deal_shards(sizes, 2, _epoch_generator(0))
    for rank in range(2):
        batches, ds = rank_batches(shards, 2, rank, 0)
        opened = set(ds.reader._files)
        extra = opened - set(owned[rank])
        assert len(extra) <= 1, f"rank {rank} opened shards {sorted(opened)}, owns {owned[rank]}"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mid_epoch_resume_at_the_same_world_size_is_exact(shards: Path, workers):
    for rank in range(2):
        full = rank_batches(shards, 2, rank, 1, epoch=1)[0]
        resumed = rank_batches(shards, 2, rank, workers, epoch=1, start=2)[0]
        assert resumed == full[2 * 3:], "per_rank 6 = 3 micro-batches per step: the tail after 2 steps"


def test_a_resume_that_changes_the_order_says_what_changes():
    assert data_order_warning(1, 0, "shard_local", "shard_local", 4, 2) == "", "a new epoch is complete in any order"
    assert data_order_warning(1, 5, "exact", "exact", 4, 2) == "", "the exact order does not depend on the world size"
    assert data_order_warning(1, 5, "shard_local", "shard_local", 4, 4) == ""
    moved = data_order_warning(1, 5, "shard_local", "shard_local", 4, 2)
    assert "written by 4 process(es), this run has 2" in moved and "rest of epoch 1 (from its step 5)" in moved
    assert "resume on 4 process(es)" in moved
    switched = data_order_warning(0, 3, "", "shard_local", 2, 2)
    assert "written with data.order=exact, this run has data.order=shard_local" in switched
    assert "set data.order=exact" in switched


def test_too_few_shards_per_rank_is_a_warning():
    import logging

    level, text = shard_local_summary([100, 100, 100], 4)
    assert level == logging.WARNING and "up to about 25% of an epoch" in text and "e.g. 4 (hpctrain shard" in text
    level, text = shard_local_summary([100] * 6, 4)
    assert level == logging.WARNING and "up to about 17% of an epoch" in text and "e.g. 8 (hpctrain shard" in text
    level, text = shard_local_summary([100] * 15 + [120], 4)
    assert level == logging.INFO and "16 shards (1620 samples) dealt to 4 ranks" in text
    assert "up to about 0% of an epoch (at most 120 samples a rank, the largest shard)" in text


def test_bytes_per_node_follow_the_read_plan():
    """benchmarks/archive/2026-11/shared_fs_bytes.py on a layout where the answer is known: 8 equal shards, 2 nodes
    x 2 ranks. The exact order has every node read every shard; shard_local has each rank read its 2 shards, so each node half."""
    from tests.conftest import benchmark_module

    with benchmark_module("archive/2026-11/shared_fs_bytes") as bench:
        ds = bench.DataSet("t", 8 * 64, 1000)  # 1000-byte samples: a record of 1536 + 1024 bytes
        layout = bench.tar_layout(ds, 64 * 2560)
        assert layout.sizes == [64] * 8
        total = layout.shard_bytes.sum()
        block = 1 << 18  # a block holds a whole shard: every node needs some sample of every shard in exact order
        for order, share in (("exact", 1.0), ("shard_local", 0.5)):
            o = bench._order(order, tuple(layout.sizes), 2, 2, 16, 32)
            per_node = bench.node_bytes(layout, o, 2, 2, 16, block)
            assert per_node.tolist() == pytest.approx([total * share] * 2), order
        one = bench.node_bytes(layout, bench._order("exact", tuple(layout.sizes), 1, 2, 16, 32), 1, 2, 16, block)
        assert one.tolist() == [total], "one node reads the set once, partial last blocks counted at their length"
        # Unshuffled, blocks of 32 records: step k is samples 64k..64k+63, node 0's two ranks take the first 32 (the
        # first block of a shard), node 1's the next 32 (the second block); nobody needs the header-only third.
        halves = bench.node_bytes(layout, torch.arange(512), 2, 2, 16, 32 * 2560)
        assert halves.tolist() == [8 * 32 * 2560] * 2, "a node's ranks are consecutive: ranks 0, 1 on node 0"


def test_the_bytes_benchmark_prints_its_table(capsys):
    from tests.conftest import benchmark_module

    with benchmark_module("archive/2026-11/shared_fs_bytes") as bench:
        bench.main(["--sets", "cifar10", "--nodes", "1,4", "--ranks-per-node", "2", "--per-rank", "16",
                    "--shard-mb", "4"])
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("| data set | size (GB) | shards | nodes |") and len(out) == 5
    assert out[3].startswith("| CIFAR-10 (PNG) | 0.205 | 49 | 1 | 0.205 (1.00) | 0.205 (1.000) |")


def test_shard_local_on_a_set_that_is_not_sharded_says_what_to_do(tmp_path: Path, capsys):
    from hpctrain.cli import main

    assert main(["train", "digits", "data.order=shard_local", f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "data.order=shard_local needs a sharded training set (a ShardDataset); experiment digits" in err
    assert "or set data.order=exact" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def _run_config(*overrides: str):
    from hpctrain.config import load_config
    from hpctrain.experiments import resolve_experiment

    cls = resolve_experiment("tests.shard_experiment:ShardClassifier")
    return load_config("tests.shard_experiment:ShardClassifier", cls.config_class, experiment_defaults=cls.defaults,
                       overrides=list(overrides))


def test_training_takes_the_order_data_order_names(shards: Path):
    """train_order as build_context calls it: the sampler gets the shard-local order for this world size, or the
    exact one; a set without a layout-aware order is refused."""
    from types import SimpleNamespace

    from hpctrain.train.run import train_order

    ds = ShardDataset(shards, ["cls"], window=8)
    data, plan = SimpleNamespace(train=ds), batch_sizes(12, 2, 2)
    local = train_order(_run_config("data.order=shard_local"), runtime(1, 2), data, plan)
    expected = shard_local_order(ds.sizes, SEED, 1, 8, RankLayout(2, 6))
    assert torch.equal(local(SEED, 1, True), expected)
    exact = train_order(_run_config(), runtime(1, 2), data, plan)
    assert torch.equal(exact(SEED, 1, True), ds.epoch_order(SEED, 1, True))
    assert not torch.equal(exact(SEED, 1, True), expected)
    custom = SimpleNamespace(train=SimpleNamespace(epoch_order=lambda seed, epoch, shuffle: torch.arange(78)))
    with pytest.raises(Exception, match="data.order=shard_local needs a sharded training set"):
        train_order(_run_config("data.order=shard_local"), runtime(0, 2), custom, plan)


def test_a_resume_records_this_runs_order_and_warns_from_the_saved_one(caplog):
    """_continue_from: the saved order and world size against this launch's; the state goes on in this run's order."""
    import logging
    from types import SimpleNamespace

    from hpctrain.train.run import _continue_from

    def resume(saved_order: str, saved_world: int, order: str, world: int):
        ctx = SimpleNamespace(cfg=_run_config(f"data.order={order}"), runtime=runtime(0, world), total_steps=100)
        info = {"step": 7, "epoch": 1, "step_in_epoch": 3, "samples_seen": 84, "global_batch_size": 12,
                "data_order": saved_order}
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hpctrain"):
            state = _continue_from(ctx, SimpleNamespace(info=info, path=Path("ckpt"), saved_world_size=saved_world))
        return state, caplog.text

    state, text = resume("exact", 2, "shard_local", 2)
    assert state.data_order == "shard_local" and (state.epoch, state.step_in_epoch) == (1, 3)
    assert "written with data.order=exact, this run has data.order=shard_local" in text
    _, text = resume("shard_local", 4, "shard_local", 2)
    assert "written by 4 process(es), this run has 2" in text
    _, text = resume("shard_local", 2, "shard_local", 2)
    assert "follows this run's order" not in text


@pytest.mark.parametrize("shards,ranks", [(533, 512), (768, 512), (3, 4), (9, 4), (12, 4)])
def test_the_borrowed_share_is_what_the_order_borrows_for_equal_shards(shards, ranks):
    from hpctrain.data.shard_local import borrowed_share

    sizes = [ranks] * shards  # an epoch of whole steps: nothing dropped, so the borrowing is the whole difference
    order = shard_local_order(sizes, SEED, 0, 8, RankLayout(ranks, 1), shuffle=False)
    owned = deal_shards(sizes, ranks, None)
    shard = owner_of(sizes)
    read = order[: len(order) // ranks * ranks].reshape(-1, ranks)
    borrowed = sum(shard[i] not in owned[r] for r in range(ranks) for i in read[:, r].tolist())
    assert borrowed / sum(sizes) == pytest.approx(borrowed_share(shards, ranks), abs=1 / sum(sizes) + 1e-9)
