"""Slot mapping (docs/design.md#where-a-token-lives): every token has exactly one home in its DCP group."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshard.kv.layout import DCPLayout


@st.composite
def layouts(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    interleave = draw(st.sampled_from([i for i in (1, 2, 4, 8, 16) if block_size % i == 0]))
    dcp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    return DCPLayout(block_size, dcp, interleave)


@settings(max_examples=200, deadline=None)
@given(layout=layouts(), length=st.integers(0, 300), data=st.data())
def test_every_token_has_one_owner_and_a_private_slot(layout: DCPLayout, length: int, data):
    num_blocks = layout.num_virtual_blocks(length)
    # a shuffled, non-contiguous block table, as a real pool hands out
    table = data.draw(st.permutations(list(range(3 * num_blocks + 1))))[:num_blocks]
    owned: dict[int, list[int]] = {r: [] for r in range(layout.dcp_size)}
    for p in range(length):
        owned[layout.owner(p)].append(p)
    for rank, positions in owned.items():
        slots = [layout.slot(p, table) for p in positions]
        assert len(set(slots)) == len(slots), "two tokens of one rank share a slot"
        assert all(s // layout.block_size in table for s in slots)
        assert layout.local_len(length, rank) == len(positions)
        # the owner packs its tokens densely, in order, across its blocks
        local = layout.local_slots_of(torch.tensor([table or [0]]), len(positions))[0].tolist()
        assert local == slots
    assert sum(layout.local_len(length, r) for r in range(layout.dcp_size)) == length


@settings(max_examples=100, deadline=None)
@given(layout=layouts(), lengths=st.lists(st.integers(1, 200), min_size=1, max_size=6))
def test_tensor_forms_equal_the_scalar_specification(layout: DCPLayout, lengths: list[int]):
    tables = [[7 * i + j for j in range(layout.num_virtual_blocks(n))] for i, n in enumerate(lengths)]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    rows = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    expected_slots = [layout.slot(int(p), tables[int(r)]) for p, r in zip(positions, rows)]
    assert layout.slots_of(positions, padded[rows]).tolist() == expected_slots
    assert layout.owner_of(positions).tolist() == [layout.owner(int(p)) for p in positions]
    for rank in range(layout.dcp_size):
        assert layout.local_lens_of(torch.tensor(lengths), rank).tolist() == [layout.local_len(n, rank) for n in lengths]


def test_interleave_one_deals_tokens_round_robin():
    layout = DCPLayout(block_size=4, dcp_size=4, interleave=1)
    assert [layout.owner(p) for p in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [layout.local_offset(p) for p in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_interleave_block_size_gives_whole_blocks():
    layout = DCPLayout(block_size=4, dcp_size=2, interleave=4)
    assert [layout.owner(p) for p in range(10)] == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    # position 8 starts the second virtual block: first physical block of rank 0 there
    assert layout.slot(8, [5, 9]) == 9 * 4


def test_local_len_matches_design_formula_with_imbalance_of_at_most_interleave():
    layout = DCPLayout(block_size=16, dcp_size=4, interleave=16)
    lens = [layout.local_len(50, r) for r in range(4)]
    assert lens == [16, 16, 16, 2]
    assert max(lens) - min(lens) <= layout.interleave
