"""Tensor-parallel linear layers, named as in vLLM.

Each parameter has a `weight_loader(param, loaded, shard_id=None)` that cuts
this rank's slice from the full checkpoint tensor, so sharding sits next to the
layer that needs it.
"""

from __future__ import annotations

import torch
from torch import nn

from kvshard.parallel import ParallelState, tp_all_reduce


def _parameter(shape: tuple[int, ...], dtype: torch.dtype, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


def copy_whole(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _parameter((out_features, in_features), dtype, copy_whole)
        self.bias = _parameter((out_features,), dtype, copy_whole) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """Output features split over TP; the input is replicated, no communication."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, parallel: ParallelState
    ) -> None:
        super().__init__()
        if out_features % parallel.tp_size:
            raise ValueError(f"{out_features} output features do not split over tp={parallel.tp_size}")
        self.parallel = parallel
        self.out_per_rank = out_features // parallel.tp_size
        self.weight = _parameter((self.out_per_rank, in_features), dtype, self.weight_loader)
        self.bias = _parameter((self.out_per_rank,), dtype, self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rank = self.parallel.tp_rank
        param.data.copy_(loaded.narrow(0, rank * self.out_per_rank, self.out_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of equal input, stored as one (gate_up_proj)."""

    def __init__(
        self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype, parallel: ParallelState
    ) -> None:
        super().__init__(in_features, sum(out_sizes), bias, dtype, parallel)
        self.out_sizes = out_sizes

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        tp, rank = self.parallel.tp_size, self.parallel.tp_rank
        size = self.out_sizes[shard_id] // tp
        offset = sum(self.out_sizes[:shard_id]) // tp
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class QKVParallelLinear(nn.Module):
    """Q, K and V of given spans of heads in one matmul (ParallelState.attention_heads says which):
    the rank's query heads and its DCP group's KV heads."""

    def __init__(
        self, hidden_size: int, head_dim: int, q_heads: range, kv_heads: range, bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q_heads, self.kv_heads = q_heads, kv_heads
        self.num_heads, self.num_kv_heads = len(q_heads), len(kv_heads)
        rows = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.weight = _parameter((rows, hidden_size), dtype, self.weight_loader)
        self.bias = _parameter((rows,), dtype, self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, size, start = 0, q_size, self.q_heads.start * d
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, self.kv_heads.start * d
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        return q.unflatten(-1, (self.num_heads, d)), k.unflatten(-1, (self.num_kv_heads, d)), v.unflatten(-1, (self.num_kv_heads, d))


class RowParallelLinear(nn.Module):
    """Input features split over TP; the partial products are summed with one all-reduce."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, parallel: ParallelState
    ) -> None:
        super().__init__()
        if in_features % parallel.tp_size:
            raise ValueError(f"{in_features} input features do not split over tp={parallel.tp_size}")
        self.parallel = parallel
        self.in_per_rank = in_features // parallel.tp_size
        self.weight = _parameter((out_features, self.in_per_rank), dtype, self.weight_loader)
        self.bias = _parameter((out_features,), dtype, copy_whole) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rank = self.parallel.tp_rank
        param.data.copy_(loaded.narrow(1, rank * self.in_per_rank, self.in_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(nn.functional.linear(x, self.weight), self.parallel)
        return y + self.bias if self.bias is not None else y


class PartialRowParallelLinear(RowParallelLinear):
    """Row-parallel without its own all-reduce: the MoE block sums this partial with the
    routed experts' partial and reduces both at once."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, parallel: ParallelState) -> None:
        super().__init__(in_features, out_features, False, dtype, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class HeadParallelLinear(nn.Module):
    """Column-parallel by attention heads over a given span of heads (q_proj, q_b_proj): the
    heads whose query the rank computes (ParallelState.attention_heads(...).query)."""

    def __init__(self, in_features: int, head_size: int, heads: range, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_size = head_size
        self.heads = heads
        self.weight = nn.Parameter(torch.empty(len(heads) * head_size, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded.narrow(0, self.heads.start * self.head_size, len(self.heads) * self.head_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)
