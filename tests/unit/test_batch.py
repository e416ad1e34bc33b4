import pytest

from hpctrain.config.batch import batch_sizes, steps_per_epoch, valid_micro_batch_sizes
from hpctrain.errors import UserError


@pytest.mark.parametrize("world, accum", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_accumulation_keeps_the_global_batch(world, accum):
    plan = batch_sizes(256, 32, world)
    assert plan.grad_accum == accum
    assert plan.micro_batch_size * plan.world_size * plan.grad_accum == 256


def test_micro_batch_that_does_not_divide_lists_valid_sizes():
    with pytest.raises(UserError) as err:
        batch_sizes(96, 20, 4)  # 24 per rank
    assert "train.micro_batch_size=20" in str(err.value)
    assert "1, 2, 3, 4, 6, 8, 12, 24" in err.value.hint


def test_global_batch_not_divisible_by_world():
    with pytest.raises(UserError, match="cannot be split evenly across 3 processes"):
        batch_sizes(100, 25, 3)
    assert valid_micro_batch_sizes(100, 3) == []


def test_steps_per_epoch_drops_the_last_partial_batch():
    assert steps_per_epoch(1400, 100) == 14
    assert steps_per_epoch(1450, 100) == 14
    with pytest.raises(UserError, match="fewer than one global batch"):
        steps_per_epoch(50, 100)


def test_a_micro_batch_that_does_not_divide_lists_the_valid_sizes_on_one_process_too():
    """The config's own check (before the number of processes is known) fires first on 1 process: its hint lists
    the values as the N-process error does."""
    from hpctrain.config import load_config
    from hpctrain.experiments.digits import DigitsExperiment, DigitsOptions

    with pytest.raises(UserError) as err:
        load_config("digits", DigitsOptions, experiment_defaults=DigitsExperiment.defaults,
                    overrides=["train.micro_batch_size=30"])  # global batch 100
    assert "valid train.micro_batch_size values for 1 process: 1, 2, 4, 5, 10, 20, 25, 50, 100" in err.value.hint
    assert "100/N" in err.value.hint
