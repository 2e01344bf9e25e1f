"""Per-rank block accounting, in virtual blocks, kept by the scheduler on rank 0.

Every rank of a DCP group (and every DCP group: they hold other KV heads of the
same tokens) has the same number of physical blocks, and a virtual block id
names one physical block on each rank, so one free list serves all ranks.

With prefix caching a block may hold the K/V of a named prefix (kv/prefix_cache.py).
Requests share such blocks (a reference count per block), and a named block whose
last request ends stays named and free: a later request with the same prefix takes
it back, and allocation reuses it only when no unnamed free block is left, the least
recently freed first. Named blocks are full and never written again, so sharing
them needs no copy.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from kvshard.kv.prefix_cache import BlockHash


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks  # requests holding each block
        self._empty: deque[int] = deque(range(num_blocks))  # free, holding nothing anyone can look up
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free and named, least recently freed first
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a named prefix, in use or free (the same count on every rank)."""
        return len(self._block_of)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise NoFreeBlocks(f"asked for {count} blocks, {self.num_free} free")
        blocks = []
        for _ in range(count):
            if self._empty:
                block = self._empty.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
                self.num_evictions += 1
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Give a request's blocks in order: the last ones are
        evicted first, since a prefix hit needs every block before the one it ends in."""
        for block in reversed(blocks):
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} freed more often than taken")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._empty.append(block)

    # --- prefix caching ------------------------------------------------------------------
    def lookup(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks holding the longest cached prefix of the chain `hashes` (not taken yet)."""
        blocks = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_unheld(self, blocks: list[int]) -> int:
        """How many of `blocks` are free: taking them costs free blocks like an allocation."""
        return sum(self.ref_counts[b] == 0 for b in blocks)

    def take(self, blocks: list[int]) -> None:
        """Add a reference to cached blocks a request reuses; free ones leave the free list."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1

    def name(self, block: int, block_hash: BlockHash) -> None:
        """Record that a held, full block holds the prefix `block_hash`. If another block already
        holds it (two requests computed it at once), this one stays unnamed and is not shared."""
        if block in self._hash_of or block_hash in self._block_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every named prefix. Blocks in use keep their content for their requests."""
        self._empty.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()
