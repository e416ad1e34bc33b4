"""The torch compatibility layer: the version floor and what differs between the floor and the pinned torch.
CI runs this file (with the unit tier) on the floor torch too, where the single-use stager of torch 2.11 shows."""

import pytest
import torch

from hpctrain import compat
from hpctrain.checkpoint import state_dicts as dcp_state
from hpctrain.errors import UserError
from tests.unit.test_async_checkpoint import train_step, training_state


@pytest.mark.parametrize("text, parsed", [("2.11.0+cu130", (2, 11)), ("2.14.1", (2, 14)), ("2.15.0a0+git1f2e3d", (2, 15)),
                                          ("10.0", (10, 0))])
def test_versions_parse_to_major_minor(text: str, parsed: tuple[int, int]):
    assert compat.parse_version(text) == parsed


def test_a_torch_below_the_floor_is_refused_with_what_to_install():
    compat.check_torch("2.11.0+cu130")
    compat.check_torch(torch.__version__)  # the torch these tests run on is supported
    with pytest.raises(UserError) as err:
        compat.check_torch("2.4.1+cu121")
    assert "needs torch >= 2.11" in str(err.value) and "2.4.1+cu121" in str(err.value)
    assert "pip install 'torch>=2.11'" in err.value.hint


def test_the_floor_is_the_one_pyproject_and_the_readme_state():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    floor = f"{compat.TORCH_FLOOR[0]}.{compat.TORCH_FLOOR[1]}"
    assert f'"torch>={floor}"' in (root / "pyproject.toml").read_text()
    assert f"torch >= {floor}" in (root / "README.md").read_text()


def test_the_checkpoint_stager_copies_the_training_state_at_every_save():
    """The copy routine of every asynchronous save (DCP's DefaultStager; on GPUs the same one with pinned buffers),
    on the state tree the Checkpointer gives it (model, AdamW moments, EMA), three saves in a row. torch 2.11 and
    2.12 clear the stager's deepcopy table after each stage: reusing one stager failed the second save with
    KeyError: <class 'type'>, which ended every GPU run on 2.11 at its second checkpoint."""
    stateful = training_state(1)
    stager = compat.CheckpointStager(cuda=False)
    buffers: list[dict[str, int]] = []
    try:
        for _ in range(3):
            live = dcp_state.tensor_state(stateful)
            staged = stager.stage(live)
            flat_live, flat_staged = _flatten(live), _flatten(staged)
            buffers.append({n: t.untyped_storage().data_ptr() for n, t in flat_staged.items() if t.numel() > 1})
            assert flat_live.keys() == flat_staged.keys() and len(flat_live) > 10
            for name, tensor in flat_live.items():
                assert torch.equal(flat_staged[name], tensor), name
                assert flat_staged[name].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr(), name
            train_step(stateful)  # the copy is private: training changes the live tensors, not the staged ones
            changed = _flatten(dcp_state.tensor_state(stateful))
            assert any(not torch.equal(changed[n], flat_staged[n]) for n in flat_staged)
    finally:
        stager.close()
    # the buffers are kept from one save to the next (fresh ones would be pinned again at every save on a GPU)
    assert buffers[0] == buffers[1] == buffers[2]


def _flatten(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}"))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            out.update(_flatten(value, f"{prefix}.{i}"))
    return out
