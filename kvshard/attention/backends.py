"""Attention backends: the attention of a step's context rows over this rank's paged KV cache,
returning the output and its natural-log LSE.

This is the part of an attention layer below the DCP rhythm (attention/backend.py: the Q
all-gather, the merge by LSE, the ReduceScatter or all-to-all): each rank attends its queries
over its own shard, and the merge above does not care which backend did it. Three of them:

- `reference`: plain matmuls over each row's tokens, picked by indexing; any device; the oracle.
- `gather-flash`: each group's blocks copied out (`KVCacheLayer.gather`), then PyTorch's CPU
  flash kernel (`attention_with_lse`), what `Attention._attend_context` runs today.
- `paged`: the C++ kernel of attention/paged.py, reading the blocks where they lie.

Every backend takes the same inputs: q [c, H, dk] (the context rows of the step, in the order of
the metadata's groups), the layer's `KVCacheLayer`, the step's `AttentionMetadata` and the softmax
scale; and returns o [c, H, dv] and lse [c, H], float32; a row that sees no cached token (a DCP
rank holding none of a short request) gets o = 0 and lse = -inf. The engine does not use this
module yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvshard.attention import paged
from kvshard.attention.kernels import attention_with_lse, reference_attention_with_lse
from kvshard.attention.metadata import AttentionMetadata
from kvshard.kv.cache import KVCacheLayer


@dataclass(frozen=True)
class ContextRows:
    """The context rows of a step as the paged kernel reads them: one block table per request
    and, per row, its request and how many of its local cached tokens it sees."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    row_seq: torch.Tensor  # [c] int32
    row_lens: torch.Tensor  # [c] int32

    @classmethod
    def from_metadata(cls, meta: AttentionMetadata) -> "ContextRows":
        """From the groups: a group's requests see the tokens its bias leaves at 0 (a prefix)."""
        tables, seqs, lens = [], [], []
        for group in meta.groups:
            if group.end > meta.context_rows:
                group_rows = max(0, meta.context_rows - group.start)
            else:
                group_rows = group.end - group.start
            if group_rows == 0:
                continue
            if group.context_blocks is None:
                seen = [0] * group.num_seqs
                blocks = [torch.zeros(1, dtype=torch.long)] * group.num_seqs
            else:
                seen = (group.context_bias[:, 0] == 0).sum(-1).tolist()
                blocks = list(group.context_blocks.cpu())
            for i in range(group_rows):
                seq = i // group.query_len
                seqs.append(len(tables) + seq)
                lens.append(seen[seq])
            tables.extend(blocks[: -(-group_rows // group.query_len)])
        width = max((t.numel() for t in tables), default=1)
        table = torch.zeros(max(1, len(tables)), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : t.numel()] = t
        return cls(table, torch.tensor(seqs, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32))


class AttentionBackend(Protocol):
    name: str

    def attend_context(self, q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """o [c, H, dv], lse [c, H] (float32) of the context rows q [c, H, dk] over the cache."""
        ...


def _value_scale(cache: KVCacheLayer) -> float:
    # MLA reads its value from the key's channels: stored with the key's scale
    return cache.scales.key if cache.value_is_view else cache.scales.value


def _quantized(cache: KVCacheLayer) -> bool:
    return cache.key.dtype != cache.dtype


class _RowsCache:
    """The step's ContextRows, worked out once and reused by every layer of the step."""

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._rows: ContextRows | None = None

    def rows(self, meta: AttentionMetadata) -> ContextRows:
        if self._meta is not meta:
            self._meta, self._rows = meta, ContextRows.from_metadata(meta)
        return self._rows


class ReferenceBackend:
    """Plain matmuls over each row's visible tokens, picked by indexing the cache: any device."""

    name = "reference"

    def __init__(self) -> None:
        self._rows = _RowsCache()

    def attend_context(self, q, cache, meta, scale):
        rows = self._rows.rows(meta)
        t, heads = q.shape[:2]
        out = torch.zeros(t, heads, cache.value.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((t, heads), float("-inf"), dtype=torch.float32, device=q.device)
        b = cache.block_size
        for r, (seq, n) in enumerate(zip(rows.row_seq.tolist(), rows.row_lens.tolist())):
            if n == 0:
                continue
            j = torch.arange(n)
            slots = (rows.block_tables[seq].long()[j // b] * b + j % b).to(cache.key.device)
            keys, values = cache.key[slots].float(), cache.value[slots].float()
            if _quantized(cache):  # the stored values are x / scale
                keys, values = keys * cache.scales.key, values * _value_scale(cache)
            bias = torch.zeros(1, 1, n, device=q.device)
            o, l = reference_attention_with_lse(q[r:r + 1][None].float(), keys[None], values[None], bias, scale)
            out[r], lse[r] = o[0, 0], l[0, 0]
        return out, lse


class GatherFlashBackend:
    """Each group's blocks gathered into its buffers, then PyTorch's CPU flash kernel (the engine's path today)."""

    name = "gather-flash"

    def attend_context(self, q, cache, meta, scale):
        t, heads = q.shape[:2]
        out = torch.zeros(t, heads, cache.value.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((t, heads), float("-inf"), dtype=torch.float32, device=q.device)
        for group in meta.groups:
            if group.context_blocks is None or group.start >= t:
                continue
            rows = slice(group.start, group.end)
            keys, values = cache.gather(group.context_blocks, group.buffers)
            queries = q[rows].unflatten(0, (group.num_seqs, group.query_len))
            o, l = attention_with_lse(queries, keys, values, group.context_bias, scale)
            out[rows], lse[rows] = o.flatten(0, 1), l.flatten(0, 1)
        return out, lse


class PagedBackend:
    """The C++ paged kernel: one call for every context row, reading the blocks where they lie."""

    name = "paged"

    def __init__(self) -> None:
        if not paged.kernel_available():
            raise RuntimeError("the paged attention kernel could not be built on this machine")
        self._rows = _RowsCache()

    def attend_context(self, q, cache, meta, scale):
        rows = self._rows.rows(meta)
        quantized = _quantized(cache)
        return paged.paged_attention(
            q, cache.key, cache.value, rows.block_tables, rows.row_seq, rows.row_lens, cache.block_size, scale,
            k_scale=cache.scales.key if quantized else 1.0, v_scale=_value_scale(cache) if quantized else 1.0,
            use_kernel=True)


class TritonBackend:
    """The Triton kernels of attention/triton_paged.py: the paged path on a GPU (and on a CPU under
    Triton's interpreter, for the tests)."""

    name = "triton"

    def __init__(self) -> None:
        from kvshard.attention import triton_paged
        why = triton_paged.available()
        if why is not None:
            raise RuntimeError(f"the Triton attention backend cannot run here: {why}")
        self._kernel = triton_paged.triton_paged_attention
        self._rows = _RowsCache()

    def attend_context(self, q, cache, meta, scale):
        rows = self._rows.rows(meta)
        quantized = _quantized(cache)
        return self._kernel(
            q, cache.key, cache.value, rows.block_tables, rows.row_seq, rows.row_lens, cache.block_size, scale,
            k_scale=cache.scales.key if quantized else 1.0, v_scale=_value_scale(cache) if quantized else 1.0)


BACKENDS = {"reference": ReferenceBackend, "gather-flash": GatherFlashBackend, "paged": PagedBackend,
            "triton": TritonBackend}


def default_backend_name(device: torch.device) -> str:
    """The fastest backend available: Triton on a GPU, the paged kernel on CPU where it builds,
    else gather + flash."""
    if device.type == "cuda":
        from kvshard.attention import triton_paged
        if triton_paged.available() is None:
            return "triton"
    if device.type == "cpu" and paged.kernel_available():
        return "paged"
    return "gather-flash"


def make_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(BACKENDS)}")
    return BACKENDS[name]()
