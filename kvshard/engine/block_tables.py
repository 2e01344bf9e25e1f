"""Block tables kept on every rank and sent as changes, so that a step's plan does not grow with the context.

Each rank (rank 0's model runner too) holds every running request's block table in a persistent
table (`RankBlockTables`: one row, a *slot*, per request, on the rank's device), and rank 0's plan
carries only what changed since the plan before it (`BlockTableChanges`): the slots whose requests
left (finished, aborted, preempted, or whose table was replaced), and per changed request how many
of its blocks stay and the blocks after them. That covers every way block ids change: a request
admitted (a new table, after a prefix-cache hit too), its table growing by a block, a preempted
request back with new blocks, a disaggregated load joining the running requests, the blocks of
rejected drafts given back. The attention metadata reads the persistent table (`slot` per request).

Rank 0 works the changes out (`BlockTableSender`) from each `Sequence.block_table`, a `BlockTable`:
a list that remembers how many of its first entries no change but appending touched since the
last plan carried it; a table replaced by another object (admission, release) is new.

A rank that got out of step must not read wrong blocks: every plan is numbered (`version`, each
rank checks it follows the one it applied last), and carries each request's block count and last
block id, checked on every rank before the metadata is built (`BlockTablesOutOfSync`). With
KVSHARD_CHECK_BLOCK_TABLES=1 the plan also carries every request's whole table and each rank
compares its own with it (slow: a debugging aid).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch

if TYPE_CHECKING:
    from kvshard.engine.sequence import Sequence


class BlockTablesOutOfSync(RuntimeError):
    """A rank's block tables differ from what rank 0 sent: it would read wrong blocks."""


class BlockTable(list):
    """A request's virtual block ids. `unchanged`: how many of its first entries no change but
    appending has touched since `BlockTableSender` last sent it (0 for a new table)."""

    __slots__ = ("unchanged",)

    def __init__(self, blocks: Iterable[int] = ()) -> None:
        super().__init__(blocks)
        self.unchanged = 0

    def _touch(self, key) -> None:
        if isinstance(key, slice):
            start, _, step = key.indices(len(self))
            first = start if step == 1 else 0
        else:
            first = key + len(self) if key < 0 else key
        self.unchanged = max(0, min(self.unchanged, first))

    def __delitem__(self, key) -> None:
        self._touch(key)
        super().__delitem__(key)

    def __setitem__(self, key, value) -> None:
        self._touch(key)
        super().__setitem__(key, value)

    def pop(self, index: int = -1) -> int:
        self._touch(index)
        return super().pop(index)

    def insert(self, index: int, value: int) -> None:
        self.unchanged = 0
        super().insert(index, value)

    def remove(self, value: int) -> None:
        self.unchanged = 0
        super().remove(value)

    def clear(self) -> None:
        self.unchanged = 0
        super().clear()

    def sort(self, *args, **kwargs) -> None:
        self.unchanged = 0
        super().sort(*args, **kwargs)

    def reverse(self) -> None:
        self.unchanged = 0
        super().reverse()

    def __imul__(self, count: int):
        self.unchanged = 0
        return super().__imul__(count)


@dataclass(frozen=True)
class BlockTableChanges:
    """A plan's block tables: what changed since the plan before it, and a check of the result."""

    version: int  # this plan's number: a rank applies plan v only after plan v - 1
    freed: list[int]  # slots whose requests left since the last plan: dropped first
    updates: list[tuple[int, int, list[int]]]  # (slot, blocks kept, the blocks after them), in order
    slots: list[int]  # the slot of each request of the step, in the step's order
    num_blocks: list[int]  # each request's block count after the changes
    last_blocks: list[int]  # each request's last block id (-1: none)
    whole: list[list[int]] | None = None  # KVSHARD_CHECK_BLOCK_TABLES: every request's whole table

    @property
    def num_ids(self) -> int:
        """Block ids the changes carry (what the plan's size grows with)."""
        return sum(len(blocks) for _, _, blocks in self.updates)


@dataclass
class _Sent:
    seq: Sequence
    table: BlockTable  # the object sent: another one in `seq.block_table` is a new table
    slot: int
    num_sent: int


class BlockTableSender:
    """Rank 0: what each rank's tables hold, and the changes each plan carries."""

    def __init__(self, check: bool = False) -> None:
        self.check = check
        self.version = 0
        self._sent: dict[int, _Sent] = {}  # by seq_id
        self._free: list[int] = []  # slots to reuse (a heap: the lowest first)
        self._num_slots = 0

    def changes(self, seqs: list[Sequence]) -> BlockTableChanges:
        """The changes that bring the ranks' tables to those of `seqs` (the step's requests, in its order),
        and of every other request sent before and still holding the same table."""
        freed = []
        for seq_id, sent in list(self._sent.items()):
            if sent.seq.block_table is not sent.table:  # released (finished, preempted) or replaced
                del self._sent[seq_id]
                freed.append(sent.slot)
                heapq.heappush(self._free, sent.slot)
        updates, slots, num_blocks, last_blocks = [], [], [], []
        for seq in seqs:
            table = seq.block_table
            sent = self._sent.get(seq.seq_id)
            if sent is None:
                if not isinstance(table, BlockTable):
                    raise TypeError(f"{seq!r}: its block table is a {type(table).__name__}, not a BlockTable")
                sent = self._sent[seq.seq_id] = _Sent(seq, table, self._new_slot(), 0)
                kept = 0
            else:
                kept = min(sent.num_sent, table.unchanged)
            if kept != sent.num_sent or kept != len(table):
                updates.append((sent.slot, kept, table[kept:]))
            sent.num_sent = table.unchanged = len(table)
            slots.append(sent.slot)
            num_blocks.append(len(table))
            last_blocks.append(table[-1] if table else -1)
        self.version += 1
        whole = [list(seq.block_table) for seq in seqs] if self.check else None
        return BlockTableChanges(self.version, freed, updates, slots, num_blocks, last_blocks, whole)

    def _new_slot(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self._num_slots += 1
        return self._num_slots - 1


class RankBlockTables:
    """Every rank: the persistent block tables, one row (slot) per request rank 0 sent, on `device`;
    rows and width grow as needed."""

    def __init__(self, device: torch.device, num_slots: int = 8, num_blocks: int = 16) -> None:
        self.device = device
        self.version = 0
        self.host = torch.zeros(max(1, num_slots), max(1, num_blocks), dtype=torch.int32)
        self.lens = torch.zeros(self.host.shape[0], dtype=torch.long)
        self.on_device = self.host if device.type == "cpu" else self.host.to(device)

    @property
    def table(self) -> torch.Tensor:
        """[slots, width] int32 on the rank's device: what the attention metadata reads (row = slot)."""
        return self.on_device

    def apply(self, changes: BlockTableChanges) -> None:
        """Bring the tables to the plan's; BlockTablesOutOfSync if this rank is not where rank 0 thinks."""
        if changes.version != self.version + 1:
            raise BlockTablesOutOfSync(f"block tables: plan {changes.version} arrived after plan {self.version}: "
                                       "a plan was lost or applied twice")
        self.version = changes.version
        for slot in changes.freed:
            if slot < self.lens.shape[0]:
                self._clear(slot, 0)
        for slot, kept, blocks in changes.updates:
            have = int(self.lens[slot]) if slot < self.lens.shape[0] else 0
            if kept > have:
                raise BlockTablesOutOfSync(f"block tables: slot {slot} keeps {kept} blocks but holds {have}")
            end = kept + len(blocks)
            self._ensure(slot + 1, end)
            if blocks:
                values = torch.tensor(blocks, dtype=torch.int32)
                self.host[slot, kept:end] = values
                if self.on_device is not self.host:
                    self.on_device[slot, kept:end] = values.to(self.device)
            self._clear(slot, end)
        self._check(changes)

    def _clear(self, slot: int, end: int) -> None:
        """Slot `slot` holds `end` blocks: the entries after them are 0, as in a table padded for one step."""
        have = int(self.lens[slot])
        if have > end:
            self.host[slot, end:have] = 0
            if self.on_device is not self.host:
                self.on_device[slot, end:have] = 0
        self.lens[slot] = end

    def _check(self, changes: BlockTableChanges) -> None:
        if not changes.slots:
            return
        slots = torch.tensor(changes.slots, dtype=torch.long)
        if int(slots.max()) >= self.lens.shape[0]:
            raise BlockTablesOutOfSync(f"block tables: slot {int(slots.max())} was never sent")
        expected = torch.tensor(changes.num_blocks, dtype=torch.long)
        lens = self.lens[slots]
        last = torch.where(lens > 0, self.host[slots, (lens - 1).clamp(min=0)].long(), -1)
        bad = ((lens != expected) | (last != torch.tensor(changes.last_blocks, dtype=torch.long))).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise BlockTablesOutOfSync(
                f"block tables of plan {changes.version}: request {i} (slot {changes.slots[i]}) holds "
                f"{int(lens[i])} blocks ending in {int(last[i])}, rank 0 sent {changes.num_blocks[i]} ending in "
                f"{changes.last_blocks[i]}")
        if changes.whole is not None:
            for i, (slot, whole) in enumerate(zip(changes.slots, changes.whole)):
                if self.host[slot, : len(whole)].tolist() != whole:
                    raise BlockTablesOutOfSync(f"block tables of plan {changes.version}: request {i} (slot {slot}) "
                                               f"holds {self.host[slot, :len(whole)].tolist()}, not {whole}")

    def _ensure(self, num_slots: int, num_blocks: int) -> None:
        rows, width = self.host.shape
        if num_slots <= rows and num_blocks <= width:
            return
        rows, width = max(rows, num_slots, 2 * rows if num_slots > rows else 0), \
            max(width, num_blocks, 2 * width if num_blocks > width else 0)
        host = torch.zeros(rows, width, dtype=torch.int32)
        host[: self.host.shape[0], : self.host.shape[1]] = self.host
        lens = torch.zeros(rows, dtype=torch.long)
        lens[: self.lens.shape[0]] = self.lens
        self.host, self.lens = host, lens
        self.on_device = host if self.device.type == "cpu" else host.to(self.device)
