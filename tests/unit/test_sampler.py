import dataclasses
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hpctrain.config.batch import batch_sizes
from hpctrain.config.schema import DataSection
from hpctrain.data.loader import KeyedDataset, build_loader
from hpctrain.data.sampler import EvalBatchSampler, SampleKey, StepBatchSampler
from hpctrain.data.seeding import mix_seed
from hpctrain.dist.runtime import single_process_runtime


def steps_of(n, global_batch, micro, world, seed=0, epoch=0, start=0):
    """{step: set of sample indices, all ranks together} and the per-rank batch lists."""
    plan = batch_sizes(global_batch, micro, world)
    per_rank = []
    for rank in range(world):
        s = StepBatchSampler(n, plan, rank, seed)
        s.set_position(epoch, start)
        per_rank.append(list(s))
    steps = {}
    for rank_batches in per_rank:
        for i, batch in enumerate(rank_batches):
            assert all(isinstance(k, SampleKey) and k.epoch == epoch for k in batch)
            steps.setdefault(start + i // plan.grad_accum, set()).update(k.index for k in batch)
    return steps, per_rank


def test_step_sets_do_not_depend_on_world_size_or_accumulation():
    reference, _ = steps_of(1000, 48, 48, 1)
    for world, micro in [(1, 6), (2, 24), (2, 8), (3, 16), (4, 4), (6, 8), (8, 6)]:
        steps, _ = steps_of(1000, 48, micro, world)
        assert steps == reference, (world, micro)


def test_epoch_is_disjoint_and_complete_up_to_the_dropped_remainder():
    steps, per_rank = steps_of(1000, 48, 8, 3)
    seen = Counter(i for s in steps.values() for i in s)
    assert len(steps) == 1000 // 48 and max(seen.values()) == 1
    assert len(seen) == 48 * (1000 // 48)
    assert len({len(b) for b in per_rank}) == 1, "every rank gets the same number of micro-batches"


def test_order_changes_with_epoch_and_seed_only():
    a, _ = steps_of(500, 60, 10, 2, seed=1, epoch=0)
    assert a == steps_of(500, 60, 10, 2, seed=1, epoch=0)[0]
    assert a != steps_of(500, 60, 10, 2, seed=1, epoch=1)[0]
    assert a != steps_of(500, 60, 10, 2, seed=2, epoch=0)[0]


@pytest.mark.parametrize("world_before, world_after", [(2, 2), (2, 1), (1, 4), (4, 2)])
def test_resume_mid_epoch_on_any_world_size_continues_the_same_steps(world_before, world_after):
    full, _ = steps_of(1000, 40, 5, world_before)
    rest, _ = steps_of(1000, 40, 5, world_after, start=9)
    assert rest == {k: v for k, v in full.items() if k >= 9}
    plan = batch_sizes(40, 5, world_after)
    s = StepBatchSampler(1000, plan, 0, 0)
    s.set_position(0, 9)
    assert len(s) == len(list(s)) == (25 - 9) * plan.grad_accum


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_eval_sampler_covers_each_sample_once_with_world_independent_batches(world):
    n, b = 397, 20
    batches = [batch for r in range(world) for batch in EvalBatchSampler(n, b, r, world)]
    assert sorted(i for batch in batches for i in batch) == list(range(n))
    assert sorted(map(tuple, batches)) == sorted(map(tuple, EvalBatchSampler(n, b, 0, 1)))
    assert sum(len(EvalBatchSampler(n, b, r, world)) for r in range(world)) == len(batches)


def test_eval_sampler_with_more_ranks_than_batches_gives_some_ranks_nothing():
    assert [len(list(EvalBatchSampler(30, 20, r, 4))) for r in range(4)] == [1, 1, 0, 0]


def test_augmentation_seed_depends_on_seed_epoch_index_only():
    data = torch.arange(10.0)
    ds = KeyedDataset(data, lambda x, g: x + torch.rand((), generator=g), seed=3)
    a = ds[SampleKey(2, 7)]
    assert torch.equal(a, ds[SampleKey(2, 7)])
    assert not torch.equal(a, ds[SampleKey(3, 7)])
    assert not torch.equal(a, KeyedDataset(data, ds.transform, seed=4)[SampleKey(2, 7)])
    assert mix_seed(1, 2) != mix_seed(2, 1)


def test_loader_without_workers_matches_torch_dataloader_batches_and_rng():
    """The in-process path (no workers, no pinning) yields DataLoader's batches and draws from the global RNG
    what DataLoader draws, so a model's random stream does not change with it."""
    data = TensorDataset(torch.arange(40.0).view(20, 2), torch.arange(20))
    sampler = StepBatchSampler(20, batch_sizes(4, 2, 1), 0, seed=5)
    cfg = dataclasses.replace(DataSection(), num_workers=0, pin_memory=False)
    loader = build_loader(data, sampler, cfg, single_process_runtime(torch.device("cpu")), seed=5)

    def two_epochs(iterable):
        torch.manual_seed(0)
        batches = []
        for epoch in range(2):
            sampler.set_position(epoch, 0)
            batches += list(iterable)
        return batches, torch.rand(3)

    ours, ours_next_draw = two_epochs(loader)
    torch_batches, torch_next_draw = two_epochs(DataLoader(loader.loader.dataset, batch_sampler=sampler))
    assert len(ours) == len(torch_batches) == 20  # 5 steps of 2 micro-batches, twice
    assert all(torch.equal(a, b) for x, y in zip(ours, torch_batches) for a, b in zip(x, y))
    assert torch.equal(ours_next_draw, torch_next_draw)
