"""What every decoder model shares: embed -> layers (one attention call each) -> norm -> LM head."""

from __future__ import annotations

import torch
from torch import nn

from kvshard.attention.metadata import AttentionMetadata
from kvshard.kv.cache import KVCacheLayer


class CausalLM(nn.Module):
    """Subclasses build `self.model` (embed_tokens, layers, norm), `self.lm_head` and `self.rotary`."""

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, caches: list[KVCacheLayer]) -> torch.Tensor:
        return self.model.norm(self.last_layer_states(input_ids, meta, caches))

    def last_layer_states(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                          caches: list[KVCacheLayer]) -> torch.Tensor:
        """The last decoder layer's output [t, D], before the final norm (what an MTP module reads)."""
        cos, sin = self.rotary.cos_sin(meta.positions)  # global positions, once per step for every layer
        x = self.model.embed_tokens(input_ids)  # [t, D]
        for layer, cache in zip(self.model.layers, caches):
            x = layer(x, cos, sin, cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[t, D] -> float32 logits [t, V] on rank 0, None on the other ranks."""
        return self.lm_head.logits(hidden)
