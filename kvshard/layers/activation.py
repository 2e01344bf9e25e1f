from __future__ import annotations

import torch
from torch import nn

from kvshard.layers import fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2*I] -> [..., I]: silu(gate) * up."""
    ops = fused.ops_for(gate_up, avx512=True)
    if ops is not None:
        return ops.silu_and_mul(gate_up)
    return silu_and_mul_eager(gate_up)


def silu_and_mul_eager(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up
