from __future__ import annotations

import torch
from torch import nn

from kvshard.layers import fused
from kvshard.layers.linear import copy_whole


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = copy_whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused.ops_for(x, avx512=True)
        if ops is not None and self.weight.dtype == x.dtype and x.stride(-1) == 1 and self.weight.is_contiguous():
            return ops.rms_norm(x, self.weight, self.eps)
        return self.eager(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a decoder layer's residual add and the next norm, one call of the
        kernel extension where RMSNorm's is one (the sum rounded to the dtype, as the eager add rounds it)."""
        ops = fused.ops_for(x, avx512=True)
        if (ops is not None and x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype
                and self.weight.dtype == x.dtype and x.stride(-1) == 1 and residual.stride(-1) == 1
                and self.weight.is_contiguous()):
            return tuple(ops.add_rms_norm(x, residual, self.weight, self.eps))
        total = x + residual
        return self(total), total

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics, as the reference implementations do
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
