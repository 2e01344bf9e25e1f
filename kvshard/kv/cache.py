"""Allocation of one rank's paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshard.attention.backend import KVCacheLayer


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token costs per layer on a rank: GQA keeps K and V per KV head;
    MLA keeps one latent [c_kv | k_pe] per token and reads c_kv as the value."""

    num_layers: int
    num_kv_heads: int
    key_dim: int
    value_dim: int
    value_in_key: bool  # value = key[..., :value_dim] (MLA)

    @property
    def values_per_slot_per_layer(self) -> int:
        stored = self.key_dim if self.value_in_key else self.key_dim + self.value_dim
        return self.num_kv_heads * stored


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[KVCacheLayer]:
    slots = num_blocks * block_size
    layers = []
    for _ in range(spec.num_layers):
        key = torch.zeros(slots, spec.num_kv_heads, spec.key_dim, dtype=dtype, device=device)
        value = key[..., : spec.value_dim] if spec.value_in_key else torch.zeros(
            slots, spec.num_kv_heads, spec.value_dim, dtype=dtype, device=device
        )
        layers.append(KVCacheLayer(key, value, block_size))
    return layers
