"""A data set of many tensors goes to loader workers as one shared block (hpctrain.data.tensor_pack): the tensors
come back equal, views of one storage stay one storage, and a few tensors are left to torch's own sharing."""

import torch

from hpctrain.data.tensor_pack import PACK_ABOVE, pack, packable, unpack


def variable_length(n: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(int(k), generator=g), torch.tensor(int(k))) for k in torch.randint(1, 50, (n,), generator=g)]


def test_many_tensors_round_trip_through_one_block():
    data = variable_length(300)
    odd = {"strided": torch.arange(24.0).view(4, 6)[:, ::2], "half": torch.ones(3, dtype=torch.float16),
           "empty": torch.zeros(0), "text": "kept"}
    skeleton, block, views = pack([data, odd])
    assert block.is_shared() and len(views) == 2 * 300 + 3
    back_data, back_odd = unpack(skeleton, block, views)
    assert all(torch.equal(a, b) and torch.equal(la, lb) for (a, la), (b, lb) in zip(data, back_data))
    for key in ("strided", "half", "empty"):
        assert torch.equal(back_odd[key], odd[key]) and back_odd[key].stride() == odd[key].stride()
    assert back_odd["text"] == "kept"


def test_views_of_one_storage_are_packed_once():
    whole = torch.arange(10_000.0)
    pieces = list(torch.split(whole, [100] * 100))
    skeleton, block, views = pack(pieces + [torch.zeros(1) for _ in range(PACK_ABOVE)])
    assert block.nbytes < whole.nbytes + (PACK_ABOVE + 1) * 64  # the pieces' storage once, not 100 times
    back = unpack(skeleton, block, views)
    assert torch.equal(torch.cat(back[:100]), whole)
    assert back[0].untyped_storage().data_ptr() == back[99].untyped_storage().data_ptr()


def test_few_storages_are_left_to_torch():
    assert pack([torch.zeros(3) for _ in range(PACK_ABOVE)]) is None


def test_only_plain_tensors_are_packed():
    assert packable(torch.zeros(2))
    assert not packable(torch.zeros(2, requires_grad=True)) and not packable(torch.nn.Parameter(torch.zeros(2)))
    assert not packable(torch.zeros(2, dtype=torch.complex64).conj())
