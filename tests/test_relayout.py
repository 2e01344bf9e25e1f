"""Relayout between two instances' KV layouts (docs/design.md#disaggregation-and-relayout): every (token, head) of the
consumer is written exactly once, from a producer rank that holds it, at the slot the consumer's
own layout gives it; a simulated transfer reproduces the cache the consumer would have built."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshard.kv.relayout import InstanceLayout, kv_heads_of_ranks, plan_relayout

HEAD_DIM = 3


@st.composite
def instances(draw, num_kv_heads: int):
    """A valid instance for a model with `num_kv_heads` (GQA rule: a DCP group holds one set of heads)."""
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    replicas = max(1, tp // num_kv_heads)
    dcp = draw(st.sampled_from([d for d in (1, 2, 4, 8) if replicas % d == 0 and tp % d == 0]))
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    interleave = draw(st.sampled_from([i for i in (1, 2, 4, 8, 16) if block_size % i == 0]))
    return InstanceLayout.of(tp, dcp, interleave, block_size, num_kv_heads)


def shuffled_table(draw, instance: InstanceLayout, num_tokens: int) -> list[int]:
    count = instance.layout.num_virtual_blocks(num_tokens)
    return draw(st.permutations(list(range(2 * count + 1))))[:count]


def build_caches(instance: InstanceLayout, table: list[int], kv: torch.Tensor) -> list[torch.Tensor]:
    """Each rank's cache [slots, heads, d] as the instance itself would write `kv` [t, H, d] (scalar spec)."""
    layout = instance.layout
    slots = (max(table, default=0) + 1) * layout.block_size
    caches = [torch.full((slots, len(h), HEAD_DIM), float("nan")) for h in instance.rank_heads]
    for rank, heads in enumerate(instance.rank_heads):
        for p in range(kv.shape[0]):
            if layout.owner(p) == instance.dcp_rank(rank):
                caches[rank][layout.slot(p, table)] = kv[p, heads.start:heads.stop]
    return caches


@settings(max_examples=150, deadline=None)
@given(data=st.data(), num_kv_heads=st.sampled_from([1, 2, 4, 8]), num_tokens=st.integers(0, 70))
def test_every_consumer_token_and_head_is_written_once_from_a_holder(data, num_kv_heads: int, num_tokens: int):
    src, dst = data.draw(instances(num_kv_heads)), data.draw(instances(num_kv_heads))
    src_table, dst_table = shuffled_table(data.draw, src, num_tokens), shuffled_table(data.draw, dst, num_tokens)
    # slots are per rank: the same slot on two ranks of a DCP group holds two tokens
    token_at = {(src.layout.owner(p), src.layout.slot(p, src_table)): p for p in range(num_tokens)}
    writes: dict[tuple[int, int, int], int] = {}  # (dst rank, token, head) -> times written
    for t in plan_relayout(src, src_table, dst, dst_table, num_tokens):
        assert set(t.heads) <= set(src.rank_heads[t.src_rank]), "sent a head the producer rank does not hold"
        assert set(t.heads) <= set(dst.rank_heads[t.dst_rank])
        for s, d in zip(t.src_slots.tolist(), t.dst_slots.tolist()):
            p = token_at.get((src.dcp_rank(t.src_rank), s))
            assert p is not None, "sent from a slot where the producer rank holds no token"
            assert dst.layout.owner(p) == dst.dcp_rank(t.dst_rank)
            assert d == dst.layout.slot(p, dst_table), "landed at the wrong slot"
            for h in t.heads:
                writes[(t.dst_rank, p, h)] = writes.get((t.dst_rank, p, h), 0) + 1
    expected = {(r, p, h) for r, heads in enumerate(dst.rank_heads) for p in range(num_tokens)
                for h in heads if dst.layout.owner(p) == dst.dcp_rank(r)}
    assert set(writes) == expected
    assert set(writes.values()) <= {1}, "a (token, head) was written twice"


@settings(max_examples=100, deadline=None)
@given(data=st.data(), num_kv_heads=st.sampled_from([1, 2, 4]), num_tokens=st.integers(1, 70))
def test_simulated_transfer_rebuilds_the_consumer_cache(data, num_kv_heads: int, num_tokens: int):
    src, dst = data.draw(instances(num_kv_heads)), data.draw(instances(num_kv_heads))
    src_table, dst_table = shuffled_table(data.draw, src, num_tokens), shuffled_table(data.draw, dst, num_tokens)
    kv = torch.randn(num_tokens, num_kv_heads, HEAD_DIM)  # [t, H, d]
    sent = build_caches(src, src_table, kv)
    received = build_caches(dst, dst_table, torch.full_like(kv, float("nan")))
    for t in plan_relayout(src, src_table, dst, dst_table, num_tokens):
        received[t.dst_rank][t.dst_slots, t.dst_heads(dst)] = sent[t.src_rank][t.src_slots, t.src_heads(src)]
    direct = build_caches(dst, dst_table, kv)
    for got, want in zip(received, direct):
        torch.testing.assert_close(got, want, equal_nan=True)


def test_the_issue_s_layout_pairs_move_no_token_twice_and_spread_the_sending():
    # tp=2 dcp=1 -> tp=2 dcp=2 on a 1-KV-head model: both producer ranks hold everything, and
    # each consumer rank reads from a different one
    src, dst = InstanceLayout.of(2, 1, 1, 4, 1), InstanceLayout.of(2, 2, 1, 4, 1)
    transfers = plan_relayout(src, [0, 1, 2], dst, [5, 6], 10)
    assert [(t.src_rank, t.dst_rank, t.src_slots.numel()) for t in transfers] == [(0, 0, 5), (1, 1, 5)]
    # tp=1 -> tp=4 dcp=4 interleave 16 (block 16): whole blocks of 16 tokens go to one rank each
    src, dst = InstanceLayout.of(1, 1, 1, 16, 1), InstanceLayout.of(4, 4, 16, 16, 1)
    transfers = plan_relayout(src, [3, 4, 5], dst, [7], 40)
    assert [(t.dst_rank, t.dst_slots.tolist()) for t in transfers] == [
        (0, list(range(112, 128))), (1, list(range(112, 128))), (2, list(range(112, 120)))]


def test_kv_heads_of_ranks_follow_the_qkv_weights():
    assert kv_heads_of_ranks(8, 2) == (range(0, 4), range(4, 8))
    assert kv_heads_of_ranks(2, 4) == (range(0, 1), range(0, 1), range(1, 2), range(1, 2))
    assert kv_heads_of_ranks(1, 4) == (range(0, 1),) * 4
    # attention-TP over DCP groups: 3 KV heads, tp=6, dcp=2 -> A=3, one head per group of two ranks
    assert kv_heads_of_ranks(3, 6, 2) == (range(0, 1),) * 2 + (range(1, 2),) * 2 + (range(2, 3),) * 2
    # 8 KV heads at tp=4 dcp=4: A=1, every rank holds all heads
    assert kv_heads_of_ranks(8, 4, 4) == (range(0, 8),) * 4


def test_a_table_too_short_is_refused():
    layout = InstanceLayout.of(1, 1, 1, 4, 1)
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        plan_relayout(layout, [0, 1], layout, [0, 1, 2], 9)
