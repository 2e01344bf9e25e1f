"""Moving one request's KV from one instance's layout to another's (docs/design.md#disaggregation-and-relayout).

Token p of a request lives, for each KV head h, on every producer rank that holds h
and whose DCP rank is owner_P(p), at slot_P(p); it must land on every consumer rank
that holds h and whose DCP rank is owner_C(p), at slot_C(p). Both sides are pure
functions of (tp, dcp, interleave, block size, block table) and of which KV heads
each rank holds, so both instances compute the same plan on their own and each
rank moves only its own share: no rank ever holds the whole request.

When several producer ranks hold a head (tp > KV heads: replicas), each consumer
rank reads it from one of them, chosen by the consumer rank's index, so the replicas
share the sending.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshard.kv.layout import DCPLayout


def kv_heads_of_ranks(num_kv_heads: int, tp: int, dcp: int = 1) -> tuple[range, ...]:
    """The KV heads each TP rank holds, as `ParallelState.attention_heads` assigns them: attention runs
    A = tp / dcp ways, one share per DCP group (a contiguous share, or one head replicated when A
    exceeds the KV heads), and every rank of a group holds its group's share.

    MLA counts as one KV head (its latent), which every rank then holds.
    """
    attention_tp = tp // dcp
    per_share = max(1, num_kv_heads // attention_tp)
    replicas = max(1, attention_tp // num_kv_heads)
    shares = [range((g // replicas) * per_share, (g // replicas + 1) * per_share) for g in range(attention_tp)]
    return tuple(shares[r // dcp] for r in range(tp))


@dataclass(frozen=True)
class InstanceLayout:
    """Where one instance keeps a request's KV: its DCP slot mapping and the KV heads of each rank.

    Ranks are cut into contiguous DCP groups (rank r has DCP rank r % dcp); the ranks
    of a group hold the same heads and split the tokens.
    """

    layout: DCPLayout
    rank_heads: tuple[range, ...]  # KV heads held by each rank, indexed by rank

    def __post_init__(self) -> None:
        n = self.layout.dcp_size
        if len(self.rank_heads) % n != 0:
            raise ValueError(f"{len(self.rank_heads)} ranks cannot be cut into DCP groups of {n}")
        for rank, heads in enumerate(self.rank_heads):
            if heads != self.rank_heads[rank - rank % n]:
                raise ValueError(f"rank {rank} holds other KV heads than its DCP group's first rank")

    @classmethod
    def of(cls, tp: int, dcp: int, interleave: int, block_size: int, num_kv_heads: int) -> InstanceLayout:
        return cls(DCPLayout(block_size, dcp, interleave), kv_heads_of_ranks(num_kv_heads, tp, dcp))

    @property
    def tp(self) -> int:
        return len(self.rank_heads)

    def dcp_rank(self, rank: int) -> int:
        return rank % self.layout.dcp_size

    def groups_holding(self, head: int) -> list[int]:
        n = self.layout.dcp_size
        return [g for g in range(self.tp // n) if head in self.rank_heads[g * n]]

    def slots(self, positions: torch.Tensor, block_table: list[int]) -> torch.Tensor:
        """[t] -> [t]: each position's slot on its owner."""
        table = torch.tensor(block_table, dtype=torch.long).unsqueeze(0).expand(positions.numel(), -1)
        return self.layout.slots_of(positions, table)


@dataclass(frozen=True)
class RankTransfer:
    """What one producer rank sends to one consumer rank: tokens (by slot on each side) x a head range."""

    src_rank: int
    dst_rank: int
    src_slots: torch.Tensor  # [n] slots on src_rank
    dst_slots: torch.Tensor  # [n] slots on dst_rank, same order
    heads: range  # global KV heads

    def src_heads(self, src: InstanceLayout) -> slice:
        """The heads as indices into the producer rank's cache."""
        start = self.heads.start - src.rank_heads[self.src_rank].start
        return slice(start, start + len(self.heads))

    def dst_heads(self, dst: InstanceLayout) -> slice:
        start = self.heads.start - dst.rank_heads[self.dst_rank].start
        return slice(start, start + len(self.heads))


def plan_relayout(src: InstanceLayout, src_table: list[int], dst: InstanceLayout, dst_table: list[int],
                  num_tokens: int) -> list[RankTransfer]:
    """Every point-to-point move that puts the first `num_tokens` tokens of a request, stored by
    `src` in the blocks `src_table`, into `dst`'s blocks `dst_table`. Transfers are ordered by
    (src_rank, dst_rank), so both instances list them alike."""
    for side, layout, table in (("producer", src, src_table), ("consumer", dst, dst_table)):
        if layout.layout.num_virtual_blocks(num_tokens) > len(table):
            raise ValueError(f"the {side}'s block table ({len(table)} blocks) cannot hold {num_tokens} tokens")
    if src.rank_heads[-1].stop != dst.rank_heads[-1].stop:
        raise ValueError(f"the producer holds {src.rank_heads[-1].stop} KV heads, the consumer "
                         f"{dst.rank_heads[-1].stop}: both must serve the same model")
    positions = torch.arange(num_tokens)
    src_owner = src.layout.owner_of(positions)  # [t]
    dst_owner = dst.layout.owner_of(positions)
    src_slots = src.slots(positions, src_table)
    dst_slots = dst.slots(positions, dst_table)
    transfers = []
    for dst_rank, heads in enumerate(dst.rank_heads):
        dst_mine = dst_owner == dst.dcp_rank(dst_rank)
        for group, run in _source_groups(src, dst_rank, heads):
            for src_dcp_rank in range(src.layout.dcp_size):
                moved = dst_mine & (src_owner == src_dcp_rank)
                if bool(moved.any()):
                    src_rank = group * src.layout.dcp_size + src_dcp_rank
                    transfers.append(RankTransfer(src_rank, dst_rank, src_slots[moved], dst_slots[moved], run))
    transfers.sort(key=lambda t: (t.src_rank, t.dst_rank, t.heads.start))
    return transfers


def _source_groups(src: InstanceLayout, dst_rank: int, heads: range) -> list[tuple[int, range]]:
    """The producer DCP group each of `heads` is read from, as runs of consecutive heads."""
    runs: list[tuple[int, range]] = []
    for head in heads:
        holders = src.groups_holding(head)
        if not holders:
            raise ValueError(f"no producer rank holds KV head {head}")
        group = holders[dst_rank % len(holders)]
        if runs and runs[-1][0] == group and runs[-1][1].stop == head:
            runs[-1] = (group, range(runs[-1][1].start, head + 1))
        else:
            runs.append((group, range(head, head + 1)))
    return runs
