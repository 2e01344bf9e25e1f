"""Rotary position embedding on *global* positions (a DCP rank stores a token under its
global position, so RoPE must never see a rank-local index).

The inverse frequencies of scaled variants (llama3, yarn, linear, dynamic,
longrope) come from transformers' own RoPE initialisers, so kvshard reads a
checkpoint's `rope_parameters` exactly as the reference does.
"""

from __future__ import annotations

import torch

from kvshard.layers import fused


class RotaryEmbedding:
    def __init__(self, hf_config, rotary_dim: int) -> None:
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"RoPE type {rope_type!r} is not supported")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        self.inv_freq = inv_freq.float()  # [rotary_dim / 2]
        self.attention_scaling = float(scaling)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Computed once per step, shared by every layer: [t] -> ([t, rotary_dim / 2], [t, rotary_dim / 2]),
        the angle of each pair of channels (apply_rotary uses them for both halves)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x [t, h, d] rotated by position. `interleaved` pairs (0,1), (2,3), ... as some checkpoints do.

    cos, sin: [t, d/2] from RotaryEmbedding.cos_sin. The reference's x * cat(cos, cos) + cat(-x2, x1) *
    cat(sin, sin), half by half: x1 * c - x2 * s and x2 * c + x1 * s give the same bits without building
    the rotated copy."""
    ops = fused.ops_for(x)
    if (ops is not None and x.dim() == 3 and x.stride(-1) == 1 and cos.dtype == sin.dtype == torch.float32
            and cos.shape == sin.shape == (x.shape[0], x.shape[-1] // 2) and cos.is_contiguous()
            and sin.is_contiguous()):
        return ops.rotary(x, cos, sin, interleaved)
    return apply_rotary_eager(x, cos, sin, interleaved)


def apply_rotary_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       interleaved: bool = False) -> torch.Tensor:
    """apply_rotary in PyTorch's operators (the fused operator's oracle)."""
    if interleaved:
        x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [t, 1, d/2]
    if torch.compiler.is_compiling():  # the same products in one fused kernel (dynamo refuses out= views)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    out = torch.empty_like(xf)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, c, out=out1).sub_(x2 * s)
    torch.mul(x2, c, out=out2).add_(x1 * s)
    return out.to(x.dtype)
