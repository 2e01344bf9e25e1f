"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
from torch import nn

from kvshard.layers.cpu_dtypes import cpu_product_dtype
from kvshard.layers.linear import amx_linear_weight, amx_product, onednn_reordered, packed_linear
from kvshard.parallel import ParallelState, tp_all_reduce, tp_gather_to_driver


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // parallel.tp_size)  # padded so every rank has an equal slice
        self.start = parallel.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.start : self.start + self.per_rank]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return nn.functional.embedding(token_ids, self.weight)
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        y = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        y.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(y, self.parallel)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, parallel: ParallelState) -> None:
        super().__init__(vocab_size, hidden_size, dtype, parallel)
        self.register_buffer("product_weight", None, persistent=False)
        self.register_buffer("packed_weight", None, persistent=False)
        self.amx_weight = False  # the product runs through `amx_product` from the weight itself

    def keep_product_copy(self) -> bool:
        """A copy of the weight for the product on a CPU, the weight itself staying (the embedding may share it):
        oneDNN's reordered copy where oneDNN multiplies the weight's dtype (SmolLM2's head, bfloat16 at 32 rows:
        5.7 ms against torch's linear's 7.9, the same bits: BENCHMARKS.md section 24), else a float32 copy of a
        half-precision weight the CPU has no arithmetic for (layers/cpu_dtypes.py's cpu_product_dtype). Whether it
        made one. A bfloat16 weight that `amx_linear_weight` takes needs no copy: the AMX tiles read it as it lies."""
        weight = self.weight
        if weight.device.type != "cpu":
            return False
        if amx_linear_weight(weight):
            self.amx_weight = True
            return True
        product = cpu_product_dtype(weight.dtype)
        if product == weight.dtype:
            self.packed_weight = onednn_reordered(weight)
            return self.packed_weight is not None
        self.product_weight = weight.detach().to(product)
        return True

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[t, D] -> full-vocabulary logits [t, V] in float32 on rank 0, None elsewhere."""
        if self.amx_weight:
            local = amx_product(hidden, self.weight, float_out=True)
        elif self.packed_weight is not None:
            local = packed_linear(hidden, self.packed_weight).float()
        elif self.product_weight is not None:  # the float32 product, rounded as the half-precision one rounds
            local = nn.functional.linear(hidden.float(), self.product_weight).to(hidden.dtype).float()
        else:
            local = nn.functional.linear(hidden, self.weight).float()  # [t, V/tp]
        full = tp_gather_to_driver(local, self.parallel)
        return None if full is None else full[:, : self.vocab_size]
