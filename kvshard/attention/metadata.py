"""Per-step attention metadata: built once per step on each rank, read by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshard.kv.layout import DCPLayout


@dataclass(frozen=True)
class AttentionGroup:
    """Requests whose new tokens are attended together: all decodes, or one prefill chunk."""

    token_index: torch.Tensor  # [g, s] rows of the flat token batch
    new_mask: torch.Tensor  # [g, s, s] causal mask among the new tokens
    context_slots: torch.Tensor | None  # [g, Lc] this rank's cached slots, None when no context here
    context_mask: torch.Tensor | None  # [g, 1, Lc]


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor  # [t] global positions of the new tokens (RoPE uses these)
    groups: list[AttentionGroup]
    write_index: torch.Tensor  # [w] new tokens this rank owns ...
    write_slots: torch.Tensor  # [w] ... and the slots they go to
    has_context: bool  # any request has cached tokens: same answer on every rank

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def build(
        cls,
        context_lens: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        layout: DCPLayout,
        dcp_rank: int,
        device: torch.device,
    ) -> "AttentionMetadata":
        num_seqs = len(query_lens)
        max_blocks = max(1, max(len(t) for t in block_tables))
        tables = torch.zeros(num_seqs, max_blocks, dtype=torch.long)
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
        ctx = torch.tensor(context_lens, dtype=torch.long)
        qlens = torch.tensor(query_lens, dtype=torch.long)
        starts = torch.cumsum(qlens, 0) - qlens

        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), qlens)
        positions = ctx[seq_of_token] + (torch.arange(int(qlens.sum())) - starts[seq_of_token])
        owned = layout.owner_of(positions) == dcp_rank
        write_index = owned.nonzero().squeeze(1)
        write_slots = layout.slots_of(positions[write_index], tables[seq_of_token[write_index]])

        local_ctx = layout.local_lens_of(ctx, dcp_rank)
        decodes = [i for i in range(num_seqs) if query_lens[i] == 1]
        prefills = [i for i in range(num_seqs) if query_lens[i] > 1]
        groups = []
        if decodes:
            groups.append(_group(decodes, 1, starts, local_ctx, tables, layout))
        for i in prefills:
            groups.append(_group([i], query_lens[i], starts, local_ctx, tables, layout))
        return cls(
            positions=positions.to(device),
            groups=[_to(g, device) for g in groups],
            write_index=write_index.to(device),
            write_slots=write_slots.to(device),
            has_context=any(c > 0 for c in context_lens),
        )


def _group(
    seqs: list[int], query_len: int, starts: torch.Tensor, local_ctx: torch.Tensor,
    tables: torch.Tensor, layout: DCPLayout,
) -> AttentionGroup:
    index = torch.tensor(seqs)
    token_index = starts[index].unsqueeze(1) + torch.arange(query_len)  # [g, s]
    new_mask = torch.ones(query_len, query_len, dtype=torch.bool).tril().expand(len(seqs), -1, -1)
    lens = local_ctx[index]
    max_len = int(lens.max())
    if max_len == 0:
        return AttentionGroup(token_index, new_mask, None, None)
    slots = layout.local_slots_of(tables[index], max_len)  # [g, Lc]
    mask = (torch.arange(max_len) < lens.unsqueeze(1)).unsqueeze(1)  # [g, 1, Lc]
    return AttentionGroup(token_index, new_mask, slots, mask)


def _to(group: AttentionGroup, device: torch.device) -> AttentionGroup:
    if device.type == "cpu":
        return group
    move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    return AttentionGroup(*(move(t) for t in (group.token_index, group.new_mask, group.context_slots, group.context_mask)))
