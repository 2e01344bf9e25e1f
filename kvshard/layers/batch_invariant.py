"""Batch-invariant matrix products: a token's result does not depend on the other tokens of the step.

CPU BLAS libraries (oneDNN / MKL) choose their blocking, and so the order in which a
dot product is summed, from the shape of the whole product: row i of `x @ w.T` with
M = 1 rows (a GEMV) differs in its last bits from the same row computed with M = 4 or
M = 37 (measured in float32 on AMD EPYC; BENCHMARKS.md, "Batch invariance"). A greedy
choice at a near-tie then changes with the batch a request runs in.

`batch_invariant_mode()` makes every matrix product that runs under it (linear layers,
the LM head, MoE experts and router, MLA's absorption einsums) run in tiles of exactly
ROW_TILE rows, the last one padded with zeros: every call then has one shape, and the
library returns a row's result whatever the other rows hold and wherever the row sits
in its tile (also measured). It works at the level of ATen operators, so it reaches
products inside composite operators (einsum, matmul) as well.
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

_active: ContextVar[bool] = ContextVar("kvshard_batch_invariant", default=False)

aten = torch.ops.aten


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


class _RowTiledProducts(TorchDispatchMode):
    """Routes ATen's matrix products through row_tiled; every other operator runs unchanged.

    Inside __torch_dispatch__ the mode is off, so `func` on a tile runs the library kernel;
    composite products (einsum, matmul) re-enter the mode to reach their mm / bmm.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.linear.default:  # x [..., K], weight [N, K]
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
