"""Names of cached KV content: a hash per full virtual block, chained from the start of the sequence.

A virtual block's K/V depend on its own tokens and on every token before it, so
its name hashes the block's token ids together with the name of the block before
it: equal names mean equal whole prefixes, not merely equal blocks. SHA-256 rather
than Python's `hash` of a tuple: that one is 64 bits, with collisions one can build
from token ids (`hash(-1) == hash(-2)`, and tuple hashing is not collision-resistant),
and a collision would silently serve one prompt another prompt's KV. The digest
costs about a microsecond per block, next to milliseconds of model per block.
"""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: list[int]) -> BlockHash:
    """Name of a full block holding `token_ids` after the prefix named `parent` (None: the first block)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: list[int], tokens_per_block: int,
                        offset: int = 0) -> None:
    """Append the names of the full blocks of `token_ids` that `hashes` does not name yet; `token_ids`
    may start at position `offset` (a sequence's tokens from there on)."""
    for start in range(len(hashes) * tokens_per_block, offset + len(token_ids) - tokens_per_block + 1,
                       tokens_per_block):
        hashes.append(hash_block(hashes[-1] if hashes else None,
                                 token_ids[start - offset : start - offset + tokens_per_block]))
