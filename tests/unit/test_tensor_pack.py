"""A data set of many tensors goes to loader workers as one shared block (hpctrain.data.tensor_pack): the tensors
come back equal, views of one storage stay one storage, a few storages are sent as they are, and the rank's tensors
become views into the block (one copy of the data, which a later start sends as it is)."""

import torch

from hpctrain.data.tensor_pack import PACK_ABOVE, pack, packable, unpack


def variable_length(n: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(int(k), generator=g), torch.tensor(int(k))) for k in torch.randint(1, 50, (n,), generator=g)]


def test_many_tensors_round_trip_through_one_block():
    data = variable_length(300)
    odd = {"strided": torch.arange(24.0).view(4, 6)[:, ::2], "half": torch.ones(3, dtype=torch.float16),
           "empty": torch.zeros(0), "text": "kept"}
    before = [(x.clone(), n.clone()) for x, n in data]
    skeleton, blocks, views = pack([data, odd])
    assert len(blocks) == 1 and blocks[0].is_shared() and len(views) == 2 * 300 + 3
    back_data, back_odd = unpack(skeleton, blocks, views)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(before, data))
    assert all(torch.equal(a, b) and torch.equal(la, lb) for (a, la), (b, lb) in zip(data, back_data))
    for key in ("strided", "half", "empty"):
        assert torch.equal(back_odd[key], odd[key]) and back_odd[key].stride() == odd[key].stride()
    assert back_odd["text"] == "kept"


def test_views_of_one_storage_are_packed_once():
    whole = torch.arange(10_000.0)
    pieces = list(torch.split(whole, [100] * 100))
    skeleton, blocks, views = pack(pieces + [torch.zeros(1) for _ in range(PACK_ABOVE)])
    assert blocks[0].nbytes() < whole.nbytes + (PACK_ABOVE + 1) * 64  # the pieces' storage once, not 100 times
    back = unpack(skeleton, blocks, views)
    assert torch.equal(torch.cat(back[:100]), whole)
    assert back[0].untyped_storage().data_ptr() == back[99].untyped_storage().data_ptr()


def test_few_storages_are_sent_as_they_are():
    """At most PACK_ABOVE storages: no block, no copy; torch's reduction moves each into shared memory in place."""
    few = [torch.full((3,), float(i)) for i in range(PACK_ABOVE - 1)] + [torch.arange(3.0)[1:]]
    skeleton, blocks, views = pack(few)
    assert [b.data_ptr() for b in blocks] == [t.untyped_storage().data_ptr() for t in few]
    assert all(torch.equal(a, b) for a, b in zip(unpack(skeleton, blocks, views), few))


def test_the_rank_keeps_one_copy_and_a_later_start_sends_the_block_as_it_is():
    """After packing, the rank's tensors are views into the block (finding: the rank kept a second copy), so an
    in-place change reaches what the workers map, and the next start copies nothing."""
    data = [torch.full((4,), float(i)) for i in range(3 * PACK_ABOVE)]
    with torch.inference_mode():
        data.append(torch.full((4,), -1.0))  # an inference tensor is re-pointed too
    skeleton, blocks, views = pack(data)
    assert {t.untyped_storage().data_ptr() for t in data} == {blocks[0].data_ptr()}
    data[5].mul_(10)
    assert unpack(skeleton, blocks, views)[5].tolist() == [50.0] * 4  # the block is the rank's memory
    again = pack(data)
    assert [b.data_ptr() for b in again[1]] == [blocks[0].data_ptr()]  # sent as it is, not copied again
    assert all(torch.equal(a, b) for a, b in zip(unpack(*again), data))


def test_only_plain_tensors_are_packed():
    assert packable(torch.zeros(2))
    assert not packable(torch.zeros(2, requires_grad=True)) and not packable(torch.nn.Parameter(torch.zeros(2)))
    assert not packable(torch.zeros(2, dtype=torch.complex64).conj())


def test_what_torch_sends_is_pickled_at_each_call():
    """A parameter is left to torch (a descriptor valid for one process start only): each pack() pickles it again,
    and the object's current state is what goes."""
    holder = {"data": [torch.zeros(2) for _ in range(2 * PACK_ABOVE)], "w": torch.nn.Parameter(torch.ones(2))}
    first = pack(holder)
    holder["w"].data.fill_(3.0)
    holder["note"] = "changed"
    back = unpack(*pack(holder))
    assert first[0] != pack(holder)[0] and back["note"] == "changed" and back["w"].tolist() == [3.0, 3.0]
