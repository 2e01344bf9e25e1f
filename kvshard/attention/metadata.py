"""Per-step attention metadata: built once per step on each rank, read by every layer.

Requests are attended in groups of consecutive rows of the flat token batch:
a run of decodes (one new token each) of similar context lengths forms one
group; each prefill chunk is a group of its own. A decode's new token is written to the cache before
attention, so it is simply part of the sharded context; a prefill chunk
attends to itself causally and to the context cached before it.

The step's attention backend (attention/backends.py) comes with it. For a backend that reads rows
with a bound each (`causal_rows`: the paged kernel, the reference), a short chunk after cached
context (up to CAUSAL_ROWS_MAX_QUERY rows: speculative verification, the rest of a prompt after a
prefix hit) is read whole from the cache, where its own K/V are by then: its row j sees the
request's tokens up to its own position, and the chunk attends to nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from typing import TYPE_CHECKING

from kvshard import envs
from kvshard.kv.cache import GatherBuffers
from kvshard.kv.layout import DCPLayout

if TYPE_CHECKING:
    from kvshard.attention.backends import AttentionBackend


# Decodes attend in groups padded to their longest request; a group spans at most this many tokens
# of (local) context length. Each group costs a gather and a kernel call per layer, so a few groups
# of similar lengths beat one padded to the longest when lengths differ widely (long and short
# agentic contexts in one batch). The scheduler sorts decodes by length to make such groups.
DECODE_GROUP_SPREAD = envs.env("KVSHARD_DECODE_GROUP_SPREAD").default  # 1024
# A chunk after cached context of at most this many rows is read whole from the cache by a backend
# with `causal_rows` (one kernel call with the decodes, no chunk attention and no merge); longer
# chunks read the context cached before them and attend to themselves apart (the paged backend's kernel
# reads the chunk's own K/V in place: attention/backends.py), merged by LSE.
CAUSAL_ROWS_MAX_QUERY = 16


def decode_group_spread_from_env() -> int:
    """DECODE_GROUP_SPREAD, or KVSHARD_DECODE_GROUP_SPREAD: 0 gives decodes of different
    local lengths groups of their own (tests use it to reach group splitting on short contexts)."""
    return envs.get("KVSHARD_DECODE_GROUP_SPREAD")


@dataclass(frozen=True)
class AttentionGroup:
    start: int  # rows [start, end) of the flat token batch
    end: int
    query_len: int  # new tokens per request: 1 for a decode group
    # what `context_blocks` and `context_bias` are worked out from, on first use (the gather backend's:
    # the others never read them, and they grow with the context): the step's block tables [slots, width],
    # the group's requests' rows in them, and their local context lengths
    tables: torch.Tensor = field(repr=False, default=None)
    table_rows: torch.Tensor = field(repr=False, default=None)  # [g] long
    local_lens: torch.Tensor = field(repr=False, default=None)  # [g] long
    block_size: int = 0
    device: torch.device | None = field(repr=False, default=None)
    buffers: GatherBuffers = field(default_factory=GatherBuffers)  # the layers reuse them within the step
    rows_in_cache: bool = False  # a chunk read whole from the cache, row by row (see the module's doc)

    @property
    def num_seqs(self) -> int:
        return (self.end - self.start) // self.query_len

    @property
    def is_decode(self) -> bool:
        return self.query_len == 1

    @property
    def attends_itself(self) -> bool:
        """A prefill chunk whose causal attention to its own K/V is computed apart (and merged)."""
        return self.query_len > 1 and not self.rows_in_cache

    @cached_property
    def _context(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        max_len = int(self.local_lens.max())
        if max_len == 0:
            return None, None
        num_blocks = -(-max_len // self.block_size)
        blocks = self.tables[self.table_rows, :num_blocks].long()
        span = torch.arange(num_blocks * self.block_size)
        bias = torch.zeros(self.table_rows.numel(), 1, span.numel()).masked_fill_(
            (span >= self.local_lens.unsqueeze(1)).unsqueeze(1), float("-inf"))
        return blocks.to(self.device), bias.to(self.device)

    @property
    def context_blocks(self) -> torch.Tensor | None:
        """[g, nb] this rank's blocks of the requests; None if it holds no token of them."""
        return self._context[0]

    @property
    def context_bias(self) -> torch.Tensor | None:
        """[g, 1, nb * B]: 0 for this rank's cached tokens, -inf past them."""
        return self._context[1]

    @cached_property
    def shared_context_len(self) -> int | None:
        """This rank's cached tokens of each of the group's requests where they all hold as many (a long chunk's
        group is one request): the gathered keys cut to it need no bias; None where the lengths differ."""
        lens = self.local_lens
        first = int(lens[0])
        return first if first > 0 and bool((lens == first).all()) else None


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor  # [t] global positions of the new tokens (RoPE uses these)
    groups: list[AttentionGroup]
    write_index: torch.Tensor  # [w] new tokens this rank owns ...
    write_slots: torch.Tensor  # [w] ... and the slots they go to
    uses_context: bool  # some token attends to cached context: the same answer on every rank
    # rows [0, context_rows) hold every token that attends to cached context (the scheduler puts
    # decodes first, then chunks by descending context): the context path and its collectives skip
    # the rest, the first chunks of prompts. The same number on every rank (global lengths).
    context_rows: int
    has_prefill: bool  # some chunk attends to itself (`AttentionGroup.attends_itself`)
    writes_every_token: bool  # write_index is every row, in order: the layers write k and v unindexed
    backend: AttentionBackend  # what attends (attention/backends.py), the same for the whole step
    # every row as the paged kernel reads it: row r sees the first row_lens[r] of this rank's tokens
    # of the request whose blocks are block_tables[row_seq[r]] (0 for rows past context_rows)
    block_tables: torch.Tensor  # [rows, width] int32: the ranks' persistent tables, or the step's own
    row_seq: torch.Tensor  # [t] int32: the block-table row of each token's request
    row_lens: torch.Tensor  # [t] int32

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def build(
        cls,
        context_lens: list[int],
        query_lens: list[int],
        block_tables: list[list[int]] | torch.Tensor,
        layout: DCPLayout,
        dcp_rank: int,
        device: torch.device,
        decode_group_spread: int = DECODE_GROUP_SPREAD,
        backend: AttentionBackend | None = None,
        table_rows: list[int] | None = None,
    ) -> "AttentionMetadata":
        """`block_tables`: each request's blocks, or a rank's persistent tables [slots, width] int32
        (engine/block_tables.py) on `device` with `table_rows`, each request's row in them.
        `backend`: the one the model runner chose at start-up; `auto`'s when None."""
        if backend is None:
            from kvshard.attention.backends import default_backend

            backend = default_backend()
        num_seqs = len(query_lens)
        if table_rows is None:
            max_blocks = max(1, max(len(t) for t in block_tables))
            tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int32)
            rows_of_seq = torch.arange(num_seqs)
            on_device = tables.to(device)
        else:
            on_device = block_tables
            rows_of_seq = torch.tensor(table_rows, dtype=torch.long)
        ctx = torch.tensor(context_lens, dtype=torch.long)
        qlens = torch.tensor(query_lens, dtype=torch.long)
        starts = torch.cumsum(qlens, 0) - qlens

        seq_of_token = _seq_of_token(query_lens, starts)
        positions = ctx[seq_of_token] + (torch.arange(int(qlens.sum())) - starts[seq_of_token])
        write_index = (layout.owner_of(positions) == dcp_rank).nonzero().squeeze(1)
        write_slots = _slots(layout, positions[write_index], on_device, rows_of_seq[seq_of_token[write_index]])

        # a decode reads its own new token from the cache (written first); a prefill chunk does not
        is_decode = qlens == 1
        local_ctx = layout.local_lens_of(ctx + is_decode.long(), dcp_rank)
        # a row attends to context if it is a decode or continues a prompt past cached tokens
        attends = [q == 1 or c > 0 for q, c in zip(query_lens, context_lens)]
        last = max((i for i, a in enumerate(attends) if a), default=-1)
        context_rows = int(starts[last] + qlens[last]) if last >= 0 else 0
        # short chunks after cached context: read whole from the cache, each row up to its own position
        in_cache = [backend.causal_rows and 1 < q <= CAUSAL_ROWS_MAX_QUERY and c > 0
                    for q, c in zip(query_lens, context_lens)]
        # what each row sees, in global tokens: a decode and a row read in the cache up to its own
        # position, a row of any other chunk the context cached before its chunk, a first chunk nothing
        by_row = torch.tensor(in_cache, dtype=torch.bool)[seq_of_token] | is_decode[seq_of_token]
        visible = torch.where(by_row, positions + 1, ctx[seq_of_token])
        row_lens = layout.local_lens_of(visible, dcp_rank).to(torch.int32)
        row_lens[context_rows:] = 0
        groups = []
        lens = local_ctx.tolist()
        i = 0
        while i < num_seqs:
            j = i + 1
            if query_lens[i] == 1:  # a run of decodes, split where padding to the group's longest would waste
                longest = shortest = lens[i]
                while j < num_seqs and query_lens[j] == 1 and \
                        max(longest, lens[j]) - min(shortest, lens[j]) <= decode_group_spread:
                    longest, shortest = max(longest, lens[j]), min(shortest, lens[j])
                    j += 1
            start = int(starts[i])
            groups.append(AttentionGroup(start, start + (j - i) * query_lens[i], query_lens[i], on_device,
                                         rows_of_seq[i:j].to(on_device.device), local_ctx[i:j], layout.block_size,
                                         device, rows_in_cache=in_cache[i]))
            i = j
        return cls(
            positions=positions.to(device),
            groups=groups,
            write_index=write_index.to(device),
            write_slots=write_slots.to(device),
            uses_context=context_rows > 0,
            context_rows=context_rows,
            has_prefill=any(group.attends_itself for group in groups),
            writes_every_token=write_index.numel() == positions.numel(),
            backend=backend,
            block_tables=on_device,
            row_seq=rows_of_seq[seq_of_token].to(torch.int32).to(device),
            row_lens=row_lens.to(device),
        )


def _seq_of_token(query_lens: list[int], starts: torch.Tensor) -> torch.Tensor:
    """[t]: the request of each row (every query length >= 1). Not `repeat_interleave`, whose CPU kernel
    hands even a few rows to the thread pool: on a busy machine, milliseconds of waiting per step."""
    num_seqs, num_tokens = len(query_lens), int(starts[-1]) + query_lens[-1] if query_lens else 0
    if num_tokens == num_seqs:  # every request one row (decodes)
        return torch.arange(num_seqs)
    first = torch.zeros(num_tokens, dtype=torch.long)
    first[starts[1:]] = 1
    return first.cumsum(0)


def _slots(layout: DCPLayout, positions: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Cache slots of `positions` [w] of the requests whose tables are rows `rows` [w] of `tables`: one
    block id read per token (`DCPLayout.slots_of` without a copy of each token's whole table)."""
    n, i, b = layout.dcp_size, layout.interleave, layout.block_size
    vb = torch.div(positions, layout.tokens_per_virtual_block, rounding_mode="floor")
    offset = positions % layout.tokens_per_virtual_block
    local = torch.div(offset, n * i, rounding_mode="floor") * i + offset % i
    blocks = tables[rows.to(tables.device), vb.to(tables.device)].long().cpu()
    return blocks * b + local
