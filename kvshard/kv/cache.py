"""One rank's paged KV cache: what a token costs in it, its layers, and their allocation.

The spec is derived here once from the model config; the engine config's byte
accounting and the runner's allocation both read it, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvshard.config import ModelConfig


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

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes of one physical cache slot (one token, all layers)."""
        element = torch.tensor([], dtype=dtype).element_size()
        return self.num_layers * self.values_per_slot_per_layer * element


def head_dim_of(hf_config) -> int:
    """A GQA model's head dim: configs that omit `head_dim` split the hidden size evenly."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def kv_cache_spec(model: ModelConfig, attention_tp_size: int) -> KVCacheSpec:
    """The cache one rank holds for `model` when attention splits its heads `attention_tp_size`
    (A = tp / dcp) ways.

    GQA gives each DCP group its 1/A share of the KV heads, at least one whole head (with A
    above the KV heads, groups hold replicas); its ranks split that share's tokens, so a rank
    stores kv_heads / A heads for 1/N of the tokens. MLA's latent is one "KV head" shared by
    all query heads: every group keeps it whole.
    """
    cfg = model.hf_config
    if model.is_mla:
        latent = cfg.kv_lora_rank
        return KVCacheSpec(cfg.num_hidden_layers, 1, key_dim=latent + cfg.qk_rope_head_dim, value_dim=latent,
                           value_in_key=True)
    d = head_dim_of(cfg)
    heads = max(1, cfg.num_key_value_heads // attention_tp_size)
    return KVCacheSpec(cfg.num_hidden_layers, heads, key_dim=d, value_dim=d, value_in_key=False)


@dataclass
class GatherBuffers:
    """A group's gathered keys and values, kept from one layer to the next within a step.

    A fresh multi-MB buffer every layer costs more in page faults than the copy itself;
    all layers of a step gather the same blocks, so they can share these.
    """

    key: torch.Tensor | None = None  # [g*nb, B, Hk, dk]
    value: torch.Tensor | None = None  # [g*nb, B, Hk, dv]


class KVCacheLayer:
    """One layer's cache on one rank: key [slots, Hk, dk] and value [slots, Hk, dv].

    The value may be a view into the key (MLA keeps [c_kv | k_pe] and reads c_kv as V),
    in which case only the key is written.
    """

    def __init__(self, key: torch.Tensor, value: torch.Tensor, block_size: int) -> None:
        self.key = key
        self.value = value
        self.block_size = block_size
        self.value_is_view = value.data_ptr() == key.data_ptr()

    def write(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        self.key.index_copy_(0, slots, key.to(self.key.dtype))
        if not self.value_is_view:
            self.value.index_copy_(0, slots, value.to(self.value.dtype))

    def gather(self, blocks: torch.Tensor, buffers: GatherBuffers | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks [g, nb] -> keys [g, nb*B, Hk, dk], values [g, nb*B, Hk, dv], copied into `buffers`."""
        buffers = buffers if buffers is not None else GatherBuffers()
        buffers.key = self._by_block(self.key, blocks, buffers.key)
        keys = buffers.key.view(blocks.shape[0], -1, *self.key.shape[1:])
        if self.value_is_view:  # MLA: V is the leading channels of the gathered latent
            return keys, keys[..., : self.value.shape[-1]]
        buffers.value = self._by_block(self.value, blocks, buffers.value)
        return keys, buffers.value.view(blocks.shape[0], -1, *self.value.shape[1:])

    def _by_block(self, cache: torch.Tensor, blocks: torch.Tensor, reuse: torch.Tensor | None) -> torch.Tensor:
        """The blocks of `cache`, [g*nb, B, Hk, d], written into `reuse` when it has their shape."""
        per_block = cache.unflatten(0, (-1, self.block_size))  # [num_blocks, B, Hk, d]
        shape = (blocks.numel(), *per_block.shape[1:])
        out = reuse
        if out is None or out.shape != shape or out.dtype != cache.dtype:
            out = per_block.new_empty(shape)
        torch.index_select(per_block, 0, blocks.flatten(), out=out)  # far faster than per_block[blocks] on CPU
        return out


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
