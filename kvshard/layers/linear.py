"""Tensor-parallel linear layers, named as in vLLM.

Each parameter has a `weight_loader(param, loaded, shard_id=None)` that cuts
this rank's slice from the full checkpoint tensor, so sharding sits next to the
layer that needs it.
"""

from __future__ import annotations

import torch
from torch import nn

from kvshard import envs
from kvshard.attention import paged
from kvshard.layers.batch_invariant import batch_invariant_active
from kvshard.layers.cpu_dtypes import cpu_product_dtype, onednn_dtypes
from kvshard.parallel import ParallelState, tp_all_reduce

# On CPU, oneDNN multiplies by a weight reordered once into its blocked layout 1.3-2x faster than
# torch's linear, float32 and bfloat16, 1 to 512 rows (measured on AMD EPYC with AVX-512; the
# reorder is what vLLM's CPU backend does too). Row hint for the reorder: a decode batch.
ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
ONEDNN_REORDER_ROWS = 32


def _parameter(shape: tuple[int, ...], dtype: torch.dtype, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


def copy_whole(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


def onednn_reordered(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's reordered copy of a CPU weight in the dtype its products run in (`cpu_product_dtype`: the weight's
    own, or float32 for a half precision the CPU has no arithmetic for), for `packed_linear`; None where oneDNN
    cannot take it (no oneDNN, another device, a dtype it has no product for)."""
    if ONEDNN_LINEAR is None or weight.device.type != "cpu":
        return None
    product = cpu_product_dtype(weight.dtype)
    if product not in onednn_dtypes():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(product), ONEDNN_REORDER_ROWS)


def onednn_rows(rows: int) -> int:
    """The rows a product from a reordered weight runs with: `rows` itself up to 64 (a decode step's, where padding
    cost the MLA demo's step 3-15%), else rounded up to a multiple of 32 up to 2,048 and of 128 beyond. oneDNN
    builds a primitive for every shape it meets and keeps it (1,024 at most), a few hundred KB each: an engine
    meeting every token count from 1 to 2,048 grew by some 330 MB per 1,000 requests on SmolLM2 and had not
    levelled off after 1,000 (BENCHMARKS.md section 32). With these buckets a weight meets at most 126 shapes up to
    2,048 rows; the padded rows cost at most 31 of 96 rows (a prompt chunk's) and 6% from 512."""
    if rows <= 64:
        return rows
    step = 32 if rows <= 2048 else 128
    return -(-rows // step) * step


def on_bucket_rows(product, x: torch.Tensor) -> torch.Tensor:
    """product(x) run on `onednn_rows` rows, zeros padding the rest (a row's result does not depend on the others)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    padded = onednn_rows(rows)
    if padded == rows or not rows:
        return product(x)
    flat = x.reshape(rows, x.shape[-1])
    flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
    return product(flat)[:rows].unflatten(0, x.shape[:-1])


def onednn_product(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's x @ weight.T (+ bias) from the reordered weight, on `onednn_rows` rows: the eager layers' product and
    the compiled graph's opaque one."""
    return on_bucket_rows(lambda rows: ONEDNN_LINEAR(rows, packed_weight, bias, "none", [], ""), x)


# Products of bfloat16 weights on a CPU with AMX tiles run from the weight in the tiles' pair layout (`pair_weight`),
# not from oneDNN's reordered copy: a decode step's on the kernel extension's AMX tiles (`amx_linear`: 1.2-1.4x
# oneDNN's from its copy at 1 to 128 rows on SmolLM2's and Llama-3-8B's shapes, 2.3-3.2x on the GQA demo's, from the
# weight as it lies; from the pair layout, the rows the A tiles as they lie and each result row's features together,
# up to 1.8x more with the weight in cache, 1.05-1.14x from memory: BENCHMARKS.md section 42), more rows in torch's
# linear from a plain copy made for the product (`plain_weight`; oneDNN from the plain weight is as fast as from its
# copy from 384 rows: section 38). From a weight as it lies (the LM head's) the tiles take up to AMX_LINEAR_ROWS rows,
# and more than AMX_LINEAR_ALWAYS only while the rows' packed copy stays within AMX_LINEAR_ROW_BYTES (every 32 output
# features read all of it: SmolLM2's 256 rows ran 1.1x faster on the tiles, Llama-3-8B's, 2 MB a product, 0.9x); from
# the pair layout up to AMX_PAIRED_ROWS.
AMX_LINEAR_ROWS = 256
AMX_LINEAR_ALWAYS = 128
AMX_LINEAR_ROW_BYTES = 1 << 20
AMX_PAIRED_ROWS = 512


def pair_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] (N a multiple of 16, K of 32) in the AMX tiles' pair layout [N / 16, K / 32, 16, 32]: element
    [t][c][p][2n + j] is weight[16t + n][32c + 2p + j], so each 32-channel step of 16 features is one B tile of the
    tiles' products (a channel pair of each feature a 32-bit word), 1 KiB contiguous."""
    n, k = weight.shape
    return weight.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32)


def plain_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] from `pair_weight`'s layout (a copy, by the kernel extension on both threads: a weight is in
    that layout only where its AMX path runs), or the weight itself where it is [N, K]."""
    return weight if weight.dim() == 2 else paged.load_extension().amx_plain_weight(weight)


def weight_features(weight: torch.Tensor) -> tuple[int, int]:
    """[out_features, in_features] of a weight as it lies or in `pair_weight`'s layout."""
    if weight.dim() == 4:
        return weight.shape[0] * 16, weight.shape[1] * 32
    return tuple(weight.shape)


def amx_takes(rows: int, in_features: int, paired: bool = False) -> bool:
    """Whether a product of `rows` rows of `in_features` bfloat16 channels runs on the AMX tiles: from a weight in the
    pair layout up to AMX_PAIRED_ROWS rows (as fast as oneDNN from its plain copy, or faster, up there on SmolLM2's
    four shapes; more rows multiply from a plain copy, whose cost is then a few percent: BENCHMARKS.md section 42)."""
    if paired:
        return rows <= AMX_PAIRED_ROWS
    return rows <= AMX_LINEAR_ALWAYS or (rows <= AMX_LINEAR_ROWS and rows * in_features * 2 <= AMX_LINEAR_ROW_BYTES)


def amx_linear_weight(weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] multiplies through `amx_product`: KVSHARD_AMX_LINEAR is not 0, a contiguous bfloat16
    CPU weight with K a multiple of 32 and N of 16, and the kernel extension built with its AMX path on a CPU whose
    system gave this process the tiles (asking builds the extension where it is not built yet)."""
    if (not envs.get("KVSHARD_AMX_LINEAR") or weight.device.type != "cpu" or weight.dtype != torch.bfloat16
            or weight.dim() != 2 or weight.shape[1] % 32 or weight.shape[0] % 16 or not weight.is_contiguous()):
        return False
    module = paged.load_extension()
    return module is not None and bool(module.amx_ready())


def amx_or_torch_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         float_out: bool = False) -> torch.Tensor:
    """x @ weight.T (+ bias) of a weight `amx_linear_weight` took (as it lies, or in `pair_weight`'s layout): on the
    AMX tiles where `amx_takes` its rows, else (and in batch-invariant mode, which tiles torch's linear) by torch's
    linear on `onednn_rows` rows (so that oneDNN keeps a primitive for few shapes), from a plain copy of a paired
    weight (`plain_weight`: its cost grows with the weight, not with the rows). The eager layers' product and the
    compiled graph's opaque one. `float_out`: the product's bfloat16 result widened to float32 (the tiles write it
    so, without a pass of `.float()`)."""
    channels = x.shape[-1]
    flat = x.dim() == 2
    rows = x.shape[0] if flat else x.numel() // channels if channels else 0
    if x.dtype != torch.bfloat16 or not amx_takes(rows, channels, weight.dim() == 4) or batch_invariant_active():
        plain = plain_weight(weight)
        out = on_bucket_rows(lambda xs: nn.functional.linear(xs, plain, bias), x)
        return out.float() if float_out else out
    x2 = x if flat else x.reshape(rows, channels)  # 2-D rows as they come (a reshape and unflatten: ~6 us)
    if x2.stride(-1) != 1 or x2.stride(0) % 2:
        x2 = x2.contiguous()
    out = paged.load_extension().amx_linear(x2, weight, bias, float_out)
    return out if flat else out.unflatten(0, x.shape[:-1])


def amx_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                float_out: bool = False) -> torch.Tensor:
    """`amx_or_torch_product`, an opaque op in a compiled graph (which widens a `float_out` result itself)."""
    if torch.compiler.is_compiling():
        out = torch.ops.kvshard.amx_linear(x, weight, bias)
        return out.float() if float_out else out
    return amx_or_torch_product(x, weight, bias, float_out)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) by oneDNN from its reordered copy of the weight (`onednn_product`), returned in x's
    dtype (a half-precision x with a float32 copy, on AVX2: the float32 product, rounded once)."""
    dtype = x.dtype
    if packed_weight.dtype != dtype:
        x, bias = x.float(), None if bias is None else bias.float()
    if torch.compiler.is_compiling():  # inductor cannot lower it from a runtime weight: an opaque op
        out = torch.ops.kvshard.onednn_linear(x, packed_weight, bias)
    else:
        out = onednn_product(x, packed_weight, bias)
    return out.to(dtype)


class LinearBase(nn.Module):
    """What every linear layer below shares: the product x @ weight.T (+ bias), from a weight that
    `reorder_for_onednn` may have replaced by oneDNN's blocked copy of it, or marked for the AMX tiles."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("packed_weight", None, persistent=False)
        self.amx_weight = False  # the weight multiplies through `amx_product`

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, bias)
        if self.amx_weight:
            return amx_product(x, self.weight, bias)
        return nn.functional.linear(x, self.weight, bias)

    @property
    def weight_shape(self) -> torch.Size:
        """[out_features, in_features] of this rank's weight, in any of its forms."""
        if self.packed_weight is not None:
            return self.packed_weight.shape
        return torch.Size(weight_features(self.weight))

    def reorder_for_onednn(self) -> bool:
        """Put the weight in the AMX tiles' pair layout where `amx_linear_weight` takes it (`pair_weight`: the same
        Parameter, its data replaced), else keep only oneDNN's reordered copy of it (`onednn_reordered`); whether it
        did either."""
        if amx_linear_weight(self.weight):
            self.weight.data = pair_weight(self.weight.data).contiguous()
            self.amx_weight = True
            return True
        packed = onednn_reordered(self.weight)
        if packed is None:
            return False
        self.packed_weight = packed
        self.weight = None  # the reordered copy replaces it: the weights' memory is not doubled
        return True


def reorder_linear_weights(model: nn.Module) -> int:
    """Reorder every linear layer's weight for oneDNN, or mark it for the AMX tiles, once its weights are loaded
    (CPU; KVSHARD_ONEDNN_LINEAR=0 keeps torch's linear for both). Returns the number of layers reordered or marked."""
    if not envs.get("KVSHARD_ONEDNN_LINEAR"):
        return 0
    for module in model.modules():  # the LM head (not a LinearBase): a copy of its own for the product
        if hasattr(module, "keep_product_copy"):
            module.keep_product_copy()
    return sum(module.reorder_for_onednn() for module in model.modules() if isinstance(module, LinearBase))


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _parameter((out_features, in_features), dtype, copy_whole)
        self.bias = _parameter((out_features,), dtype, copy_whole) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


class ColumnParallelLinear(LinearBase):
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
        return self.linear(x, self.bias)


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


class QKVParallelLinear(LinearBase):
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
        return self.linear(x, self.bias)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        return q.unflatten(-1, (self.num_heads, d)), k.unflatten(-1, (self.num_kv_heads, d)), v.unflatten(-1, (self.num_kv_heads, d))


class RowParallelLinear(LinearBase):
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
        y = tp_all_reduce(self.linear(x), self.parallel)
        return y + self.bias if self.bias is not None else y


class PartialRowParallelLinear(RowParallelLinear):
    """Row-parallel without its own all-reduce: the MoE block sums this partial with the
    routed experts' partial and reduces both at once."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, parallel: ParallelState) -> None:
        super().__init__(in_features, out_features, False, dtype, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class HeadParallelLinear(LinearBase):
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
        return self.linear(x)
