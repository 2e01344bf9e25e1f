from __future__ import annotations

import torch
from torch import nn


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2*I] -> [..., I]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up
