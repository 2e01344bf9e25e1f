"""Where a token's K/V lives inside a DCP group (docs/design.md#where-a-token-lives).

A *virtual block* covers `block_size * dcp` consecutive positions; each rank
of the group holds one physical block of it, with the same block id on every
rank. Tokens are dealt to the ranks `interleave` at a time, round robin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DCPLayout:
    block_size: int  # B: tokens per physical block
    dcp_size: int  # N
    interleave: int = 1  # I: consecutive tokens given to one rank

    def __post_init__(self) -> None:
        if self.block_size % self.interleave != 0:
            raise ValueError(f"block_size {self.block_size} is not a multiple of interleave {self.interleave}")

    @property
    def tokens_per_virtual_block(self) -> int:
        return self.block_size * self.dcp_size

    def num_virtual_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_virtual_block)

    # --- scalar forms: the specification -----------------------------------------
    def owner(self, position: int) -> int:
        offset = position % self.tokens_per_virtual_block
        return (offset // self.interleave) % self.dcp_size

    def local_offset(self, position: int) -> int:
        """Offset of the token inside its owner's physical block."""
        n, i = self.dcp_size, self.interleave
        offset = position % self.tokens_per_virtual_block
        return (offset // (n * i)) * i + offset % i

    def local_len(self, num_tokens: int, dcp_rank: int) -> int:
        """How many of a request's first `num_tokens` tokens `dcp_rank` stores."""
        n, i = self.dcp_size, self.interleave
        base = (num_tokens // (n * i)) * i
        return base + min(max(num_tokens - base * n - dcp_rank * i, 0), i)

    def slot(self, position: int, block_table: list[int]) -> int:
        vb = position // self.tokens_per_virtual_block
        return block_table[vb] * self.block_size + self.local_offset(position)

    # --- tensor forms: what the model runner uses --------------------------------------
    def owner_of(self, positions: torch.Tensor) -> torch.Tensor:
        offset = positions % self.tokens_per_virtual_block
        return torch.div(offset, self.interleave, rounding_mode="floor") % self.dcp_size

    def slots_of(self, positions: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Slots of `positions` [t] whose requests' tables are the rows of `block_tables` [t, max_vb]."""
        n, i, b = self.dcp_size, self.interleave, self.block_size
        vb = torch.div(positions, self.tokens_per_virtual_block, rounding_mode="floor")
        offset = positions % self.tokens_per_virtual_block
        local = torch.div(offset, n * i, rounding_mode="floor") * i + offset % i
        blocks = block_tables.gather(1, vb.unsqueeze(1)).squeeze(1)
        return blocks * b + local

    def local_lens_of(self, num_tokens: torch.Tensor, dcp_rank: int) -> torch.Tensor:
        n, i = self.dcp_size, self.interleave
        base = torch.div(num_tokens, n * i, rounding_mode="floor") * i
        return base + (num_tokens - base * n - dcp_rank * i).clamp(0, i)

    def local_slots_of(self, block_tables: torch.Tensor, max_local_len: int) -> torch.Tensor:
        """[b, max_vb] -> [b, max_local_len]: a rank's share of a request fills its blocks in order.

        Local token j of a request sits at offset j % B of physical block j // B,
        whatever the interleave: the owner packs its tokens densely.
        """
        j = torch.arange(max_local_len, device=block_tables.device)
        vb = torch.div(j, self.block_size, rounding_mode="floor").clamp(max=block_tables.shape[1] - 1)
        return block_tables[:, vb] * self.block_size + j % self.block_size
