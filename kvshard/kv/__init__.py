"""The sequence-sharded, paged KV cache: where each token lives, and the blocks that hold it."""

from kvshard.kv.block_pool import BlockPool, NoFreeBlocks
from kvshard.kv.layout import DCPLayout

__all__ = ["BlockPool", "DCPLayout", "NoFreeBlocks"]
