"""What every decoder model shares: embed -> layers (one attention call each) -> norm -> LM head
(the last two for the sampled rows only)."""

from __future__ import annotations

import torch
from torch import nn


class CausalLM(nn.Module):
    """Subclasses build `self.model` (embed_tokens, layers of `PreNormDecoderLayer`, norm), `self.lm_head` and
    `self.rotary`.

    `forward` takes tensors alone; the step's metadata and caches come from the forward context the
    caller sets (kvshard/forward_context.py), so that torch.compile can trace it (kvshard/compilation.py)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens [t] at global positions [t] -> the last decoder layer's output [t, D], before the final
        norm (what an MTP module reads)."""
        cos, sin = self.rotary.cos_sin(positions)  # global positions, once per step for every layer
        x = self.model.embed_tokens(input_ids)  # [t, D]
        residual = None  # the residual stream apart from each layer's output: the add fused with the next norm
        for layer in self.model.layers:  # PreNormDecoderLayer's
            x, residual = layer.forward_residual(x, residual, cos, sin)
        return x if residual is None else x + residual

    def compute_logits(self, states: torch.Tensor) -> torch.Tensor | None:
        """Pre-norm states of the sampled rows [s, D] -> float32 logits [s, V] on rank 0, None on the
        other ranks (the final norm is row-wise: only the rows sampled need it)."""
        return self.lm_head.logits(self.model.norm(states))


class PreNormDecoderLayer(nn.Module):
    """x + attn(norm(x)), then that + mlp(norm(that)): subclasses build `input_layernorm`, `self_attn` (called with
    cos and sin), `post_attention_layernorm` and `mlp`.

    `forward_residual` keeps the residual stream apart from the last sublayer's output, as vLLM's layers do, so that
    each residual add runs in one call with the norm after it (RMSNorm's `add_and_norm`); the sums are the same
    additions in the same dtype as `forward`'s."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out, residual = self.forward_residual(x, None, cos, sin)
        return out + residual

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is x + residual (x alone where residual is None) -> (out, residual'), its output
        out + residual'."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(h, cos, sin), residual)
        return self.mlp(h), residual
