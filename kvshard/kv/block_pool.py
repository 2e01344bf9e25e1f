"""Per-rank block accounting, in virtual blocks, kept by the scheduler on rank 0.

Every rank of a DCP group (and every DCP group: they hold other KV heads of the
same tokens) has the same number of physical blocks, and a virtual block id
names one physical block on each rank, so one free list serves all ranks.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise NoFreeBlocks(f"asked for {count} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
