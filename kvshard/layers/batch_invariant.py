"""Batch-invariant matrix products: a token's result does not depend on the other tokens of the step.

CPU BLAS libraries (oneDNN / MKL) choose their blocking, and so the order in which a
dot product is summed, from the shape of the whole product: row i of `x @ w.T` with
M = 1 rows (a GEMV) differs in its last bits from the same row computed with M = 4 or
M = 37 (measured in float32 on AMD EPYC; BENCHMARKS.md, "Batch invariance"). A greedy
choice at a near-tie then changes with the batch a request runs in.

Elementwise transcendental functions have the same flaw at a smaller scale: ATen computes
whole SIMD vectors with one implementation (SLEEF) and the leftover tail of a tensor with
the scalar one (libm), which differ in the last bit. Whether an element falls in the tail
depends on the tensor's size, so the MoE router's sigmoid over [t, 8] scores gave a
token other bits alone (t = 1: all tail) than in a batch of 8 (all vectors).

`batch_invariant_mode()` makes every matrix product that runs under it (linear layers,
the LM head, MoE experts and router, MLA's absorption einsums) run in tiles of exactly
ROW_TILE rows, the last one padded with zeros: every call then has one shape, and the
library returns a row's result whatever the other rows hold and wherever the row sits
in its tile (also measured). Transcendental elementwise functions run on inputs padded to
a multiple of VECTOR_PAD elements, so that every element takes the vector path. It works
at the level of ATen operators, so it reaches products inside composite operators
(einsum, matmul) as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Rows per product. A decode batch of up to this many requests costs one call per product;
# smaller tiles pad less but make a long prefill cost more calls (BENCHMARKS.md).
ROW_TILE = 32

# Elements: a multiple of two vectors of the widest SIMD (AVX-512, 16 floats; ATen's loops
# take two vectors per iteration), with room to spare for doubles or wider units.
VECTOR_PAD = 64

_active: ContextVar[bool] = ContextVar("kvshard_batch_invariant", default=False)

aten = torch.ops.aten
# torch's linear, and oneDNN's from a reordered weight (layers/linear.py) where torch has it
_LINEAR_PRODUCTS = {aten.linear.default} | (
    {torch.ops.mkldnn._linear_pointwise.default} if hasattr(torch.ops.mkldnn, "_linear_pointwise") else set())
# functions whose vector and scalar implementations round differently
_TRANSCENDENTAL = {aten.exp.default, aten.log.default, aten.sigmoid.default, aten.silu.default,
                   aten.tanh.default, aten.sin.default, aten.cos.default, aten.erf.default,
                   aten.expm1.default, aten.log1p.default, aten.gelu.default}
_TRANSCENDENTAL_INPLACE = {aten.exp_.default: aten.exp.default, aten.sigmoid_.default: aten.sigmoid.default,
                           aten.log_.default: aten.log.default, aten.silu_.default: aten.silu.default}


def batch_invariant_active() -> bool:
    """Whether the caller runs under batch_invariant_mode (paths with a batch-dependent choice ask)."""
    return _active.get()


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Run the enclosed model code with batch-invariant matrix products; a no-op when not enabled."""
    if not enabled:
        yield
        return
    token = _active.set(True)
    try:
        with _RowTiledProducts():
            yield
    finally:
        _active.reset(token)


def row_tiled(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows_dim: int) -> torch.Tensor:
    """product(x) computed on tiles of exactly ROW_TILE rows along `rows_dim` (zero-padded), joined back."""
    num_rows = x.shape[rows_dim]
    if num_rows == 0:
        return product(x)
    padded_rows = -(-num_rows // ROW_TILE) * ROW_TILE
    if padded_rows != num_rows:
        pad_shape = list(x.shape)
        pad_shape[rows_dim] = padded_rows - num_rows
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=rows_dim)
    tiles = [product(tile) for tile in x.split(ROW_TILE, dim=rows_dim)]
    return torch.cat(tiles, dim=rows_dim).narrow(rows_dim, 0, num_rows)


def vector_padded(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """An elementwise function on x, computed contiguous and zero-padded to VECTOR_PAD elements."""
    flat = x.contiguous().view(-1)
    pad = -flat.numel() % VECTOR_PAD
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return function(flat)[: x.numel()].view(x.shape)


class _RowTiledProducts(TorchDispatchMode):
    """Routes ATen's matrix products through row_tiled and its transcendental functions through
    vector_padded; every other operator runs unchanged.

    Inside __torch_dispatch__ the mode is off, so `func` on a tile runs the library kernel;
    composite operators (einsum, matmul, logsumexp) re-enter the mode to reach their parts.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TRANSCENDENTAL:
            return vector_padded(lambda flat: func(flat, *args[1:], **kwargs), args[0])
        if func in _TRANSCENDENTAL_INPLACE:
            return args[0].copy_(vector_padded(_TRANSCENDENTAL_INPLACE[func], args[0]))
        if func is aten.logsumexp.default:  # its CPU kernel calls exp and log where the mode cannot see them
            with self:
                return _logsumexp(*args, **kwargs)
        if func in _LINEAR_PRODUCTS:  # x [..., K], weight [N, K] (torch's, or oneDNN's reordered copy)
            x, rest = args[0], args[1:]
            flat = x.reshape(-1, x.shape[-1])  # [M, K]
            out = row_tiled(lambda tile: func(tile, *rest, **kwargs), flat, 0)  # [M, N]
            return out.view(*x.shape[:-1], out.shape[-1])
        if func is aten.mm.default:  # [M, K] @ [K, N]
            return row_tiled(lambda tile: func(tile, args[1]), args[0], 0)
        if func is aten.addmm.default and args[0].dim() == 1:  # bias [N] + [M, K] @ [K, N]
            return row_tiled(lambda tile: func(args[0], tile, args[2], **kwargs), args[1], 0)
        if func is aten.bmm.default:  # [B, M, K] @ [B, K, N]: rows are the middle dimension
            return row_tiled(lambda tile: func(tile, args[1]), args[0], 1)
        if func in (aten.einsum.default, aten.matmul.default):
            with self:
                return func.decompose(*args, **kwargs)
        return func(*args, **kwargs)


def _logsumexp(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """torch.logsumexp as ATen computes it (max subtracted; an infinite max taken as 0)."""
    maxes = torch.amax(x, dim, keepdim=True)
    maxes = maxes.masked_fill(maxes.abs() == float("inf"), 0)
    out = (x - maxes).exp().sum(dim, keepdim=True).log() + maxes
    return out if keepdim else out.squeeze(dim)
