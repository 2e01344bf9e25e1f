"""What every decoder model shares: embed -> layers (one attention call each) -> norm -> LM head
(the last two for the sampled rows only)."""

from __future__ import annotations

import torch
from torch import nn


class CausalLM(nn.Module):
    """Subclasses build `self.model` (embed_tokens, layers, norm), `self.lm_head` and `self.rotary`.

    `forward` takes tensors alone; the step's metadata and caches come from the forward context the
    caller sets (kvshard/forward_context.py), so that torch.compile can trace it (kvshard/compilation.py)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens [t] at global positions [t] -> the last decoder layer's output [t, D], before the final
        norm (what an MTP module reads)."""
        cos, sin = self.rotary.cos_sin(positions)  # global positions, once per step for every layer
        x = self.model.embed_tokens(input_ids)  # [t, D]
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return x

    def compute_logits(self, states: torch.Tensor) -> torch.Tensor | None:
        """Pre-norm states of the sampled rows [s, D] -> float32 logits [s, V] on rank 0, None on the
        other ranks (the final norm is row-wise: only the rows sampled need it)."""
        return self.lm_head.logits(self.model.norm(states))
