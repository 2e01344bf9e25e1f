"""AttentionMetadata.build, without processes: one small batch worked out by hand.

The batch, block size 4, in row order:
  seq 0: decode, 5 cached tokens, new token at position 5, block table [7, 2]
  seq 1: decode, 9 cached tokens, new token at position 9, block table [1, 5, 6]
  seq 2: first prefill chunk of 3 tokens (positions 0-2), block table [3]
  seq 3: prefill chunk of 2 tokens after 4 cached ones (positions 4-5), block table [4, 8]
A decode's new token is written before attention, so it counts in its context (6 and 10 tokens);
a chunk's own tokens do not (0 and 4).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvshard.attention.metadata import (
    DECODE_GROUP_SPREAD, AttentionGroup, AttentionMetadata, decode_group_spread_from_env,
)
from kvshard.attention.backend import Attention
from kvshard.kv.cache import KVCacheSpec, allocate_kv_cache
from kvshard.kv.layout import DCPLayout
from kvshard.parallel import single_rank_state

BLOCK = 4
CONTEXT_LENS = [5, 9, 0, 4]
QUERY_LENS = [1, 1, 3, 2]
BLOCK_TABLES = [[7, 2], [1, 5, 6], [3], [4, 8]]
POSITIONS = [5, 9, 0, 1, 2, 4, 5]


def build(dcp: int, interleave: int, dcp_rank: int, spread: int = DECODE_GROUP_SPREAD) -> AttentionMetadata:
    layout = DCPLayout(BLOCK, dcp, interleave)
    return AttentionMetadata.build(CONTEXT_LENS, QUERY_LENS, BLOCK_TABLES, layout, dcp_rank, torch.device("cpu"),
                                   spread)


def summary(group: AttentionGroup) -> tuple:
    """(rows, query_len, this rank's blocks, this rank's cached tokens per request)."""
    if group.context_blocks is None:
        return (group.start, group.end), group.query_len, None, None
    bias = group.context_bias[:, 0]  # [g, nb * B]
    lens = (bias == 0).sum(-1)
    # attendable tokens are a prefix of the gathered blocks: -inf from each request's length on
    assert torch.equal(torch.isneginf(bias), torch.arange(bias.shape[1]) >= lens.unsqueeze(1))
    # where every request holds as many, the gathered keys are cut to that length and attended with no bias
    assert group.shared_context_len == (int(lens[0]) if bool((lens == lens[0]).all()) else None)
    return (group.start, group.end), group.query_len, group.context_blocks.tolist(), lens.tolist()


def test_without_dcp_every_token_is_written_and_decodes_share_a_group():
    meta = build(dcp=1, interleave=1, dcp_rank=0)
    assert meta.positions.tolist() == POSITIONS
    assert meta.write_index.tolist() == list(range(7))
    # position p of a table goes to block table[p // 4], offset p % 4
    assert meta.write_slots.tolist() == [2 * 4 + 1, 6 * 4 + 1, 12, 13, 14, 8 * 4 + 0, 8 * 4 + 1]
    assert [summary(g) for g in meta.groups] == [
        ((0, 2), 1, [[7, 2, 0], [1, 5, 6]], [6, 10]),  # padded to the longer decode's 3 blocks
        ((2, 5), 3, None, None),  # nothing cached yet: attends only to itself
        ((5, 7), 2, [[4]], [4]),
    ]
    assert meta.uses_context and meta.has_prefill and meta.num_tokens == 7
    assert meta.writes_every_token


def test_with_dcp_a_rank_writes_only_its_own_tokens():
    assert not any(build(dcp=2, interleave=1, dcp_rank=rank).writes_every_token for rank in (0, 1))


@pytest.mark.parametrize("dcp_rank, write_index, write_slots, groups", [
    # virtual block = 8 positions dealt one at a time: even offsets to rank 0, odd to rank 1,
    # at local offset (p % 8) // 2 of the table's block p // 8
    (0, [2, 4, 5], [3 * 4 + 0, 3 * 4 + 1, 4 * 4 + 2], [
        ((0, 2), 1, [[7, 2], [1, 5]], [3, 5]), ((2, 5), 3, None, None), ((5, 7), 2, [[4]], [2]),
    ]),
    (1, [0, 1, 3, 6], [7 * 4 + 2, 5 * 4 + 0, 3 * 4 + 0, 4 * 4 + 2], [
        ((0, 2), 1, [[7, 2], [1, 5]], [3, 5]), ((2, 5), 3, None, None), ((5, 7), 2, [[4]], [2]),
    ]),
])
def test_dcp2_interleave1_deals_tokens_round_robin(dcp_rank, write_index, write_slots, groups):
    meta = build(dcp=2, interleave=1, dcp_rank=dcp_rank)
    assert meta.positions.tolist() == POSITIONS  # global: RoPE sees the same positions on every rank
    assert meta.write_index.tolist() == write_index
    assert meta.write_slots.tolist() == write_slots
    assert [summary(g) for g in meta.groups] == groups


@pytest.mark.parametrize("dcp_rank, write_index, write_slots, groups", [
    # 4 consecutive positions to a rank: offsets 0-3 of a virtual block to rank 0, 4-7 to rank 1
    (0, [1, 2, 3, 4], [5 * 4 + 1, 12, 13, 14], [
        ((0, 2), 1, [[7, 2], [1, 5]], [4, 6]), ((2, 5), 3, None, None), ((5, 7), 2, [[4]], [4]),
    ]),
    (1, [0, 5, 6], [7 * 4 + 1, 4 * 4 + 0, 4 * 4 + 1], [
        ((0, 2), 1, [[7], [1]], [2, 4]), ((2, 5), 3, None, None),
        ((5, 7), 2, None, None),  # seq 3's 4 cached tokens all sit on rank 0
    ]),
])
def test_dcp2_interleave_block_size_deals_whole_blocks(dcp_rank, write_index, write_slots, groups):
    meta = build(dcp=2, interleave=BLOCK, dcp_rank=dcp_rank)
    assert meta.write_index.tolist() == write_index
    assert meta.write_slots.tolist() == write_slots
    assert [summary(g) for g in meta.groups] == groups


@pytest.mark.parametrize("spread, decode_groups", [
    (DECODE_GROUP_SPREAD, [((0, 2), 1, [[7, 2, 0], [1, 5, 6]], [6, 10])]),
    (4, [((0, 2), 1, [[7, 2, 0], [1, 5, 6]], [6, 10])]),  # 10 - 6 = 4: still one group
    (3, [((0, 1), 1, [[7, 2]], [6]), ((1, 2), 1, [[1, 5, 6]], [10])]),
    (0, [((0, 1), 1, [[7, 2]], [6]), ((1, 2), 1, [[1, 5, 6]], [10])]),
])
def test_decodes_split_into_groups_where_local_lengths_differ_by_more_than_the_spread(spread, decode_groups):
    meta = build(dcp=1, interleave=1, dcp_rank=0, spread=spread)
    assert [summary(g) for g in meta.groups if g.is_decode] == decode_groups
    assert [summary(g) for g in meta.groups if not g.is_decode] == [((2, 5), 3, None, None), ((5, 7), 2, [[4]], [4])]


def test_the_spread_compares_local_lengths():
    """At dcp 2, interleave 4, rank 0 holds 4 and 6 of the decodes' tokens: 2 apart, not 4."""
    together = build(dcp=2, interleave=BLOCK, dcp_rank=0, spread=2)
    apart = build(dcp=2, interleave=BLOCK, dcp_rank=0, spread=1)
    assert [summary(g)[0] for g in together.groups if g.is_decode] == [(0, 2)]
    assert [summary(g)[0] for g in apart.groups if g.is_decode] == [(0, 1), (1, 2)]


def test_decode_group_spread_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("KVSHARD_DECODE_GROUP_SPREAD", raising=False)
    assert decode_group_spread_from_env() == DECODE_GROUP_SPREAD
    monkeypatch.setenv("KVSHARD_DECODE_GROUP_SPREAD", "0")
    assert decode_group_spread_from_env() == 0
    monkeypatch.setenv("KVSHARD_DECODE_GROUP_SPREAD", "-1")
    with pytest.raises(ValueError, match="KVSHARD_DECODE_GROUP_SPREAD='-1' is not a non-negative integer"):
        decode_group_spread_from_env()


def test_context_rows_end_after_the_last_row_that_reads_cached_context():
    assert build(2, 1, 0).context_rows == 7  # here the chunk after 4 cached tokens (seq 3) comes last
    layout, cpu = DCPLayout(BLOCK, 2, 1), torch.device("cpu")
    # in the scheduler's order (decodes, then chunks by descending context) first chunks come last
    ordered = AttentionMetadata.build([5, 9, 4, 0], [1, 1, 2, 3], [[7, 2], [1, 5, 6], [4, 8], [3]], layout, 1, cpu)
    assert ordered.context_rows == 4 and ordered.uses_context
    first_chunks = AttentionMetadata.build([0, 0], [3, 2], [[3], [4]], layout, 0, cpu)
    assert first_chunks.context_rows == 0 and not first_chunks.uses_context


def test_attention_reads_cached_context_for_the_context_rows_only(monkeypatch):
    torch.manual_seed(0)
    cpu, state = torch.device("cpu"), single_rank_state()
    # scheduler order: two decodes, a chunk after 4 cached tokens, a first chunk (rows 4-6)
    meta = AttentionMetadata.build([5, 9, 4, 0], [1, 1, 2, 3], [[7, 2], [1, 5, 6], [4, 8], [3]],
                                   DCPLayout(BLOCK, 1, 1), 0, cpu)
    attention = Attention(state.attention_heads(4, 1), 0.25, state)
    (cache,) = allocate_kv_cache(KVCacheSpec(1, 1, 8, 8, False), 10, BLOCK, torch.float32, cpu)
    cache.key.normal_(), cache.value.normal_()
    q, k, v = torch.randn(7, 4, 8), torch.randn(7, 1, 8), torch.randn(7, 1, 8)
    rows_read = []
    attend = Attention._attend_context
    monkeypatch.setattr(Attention, "_attend_context",
                        lambda self, queries, *rest: rows_read.append(len(queries)) or attend(self, queries, *rest))
    out = attention.forward(q, k, v, cache, meta)
    every_row = attention.forward(q, k, v, cache, dataclasses.replace(meta, context_rows=7))
    assert rows_read == [4, 7]
    assert torch.equal(out, every_row)  # the first chunk's rows: its own attention, the same bits
