"""The DCP decode rhythm (DESIGN.md section 4), one call per attention layer.

First every rank writes the new tokens it owns into its cache. Then:

  (a) cached context, sharded over the DCP group (for a decode this includes
      its new token): AllGather Q over the group -> attention of all gathered
      heads over the local shard, with LSE -> AllGather LSE, rescale,
      ReduceScatter the heads back to their rank;
  (b) for prefill chunks only: causal attention over the chunk's own K/V
      (every rank of the group computed them), for this rank's heads;
  and (a) and (b) are merged by LSE. With dcp = 1 the collectives are
  identities and this is ordinary paged attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvshard.attention.kernels import attention_with_lse
from kvshard.attention.merge import lse_weights, merge_attention_states
from kvshard.attention.metadata import AttentionMetadata, int_from_env
from kvshard.kv.cache import KVCacheLayer
from kvshard.layers.batch_invariant import batch_invariant_active
from kvshard.parallel import ParallelState, dcp_all_gather, dcp_reduce_scatter

# Below this many bytes of partial output per rank, a merge costs its collectives' latency, not
# their bandwidth: one all-gather of [output | lse] replaces the LSE all-gather + ReduceScatter
# pair, at the price of moving every head instead of one rank's share.
FUSED_MERGE_MAX_BYTES = 256 * 1024


def fused_merge_max_bytes_from_env() -> int:
    """FUSED_MERGE_MAX_BYTES, or KVSHARD_FUSED_MERGE_MAX_BYTES: 0 always takes the LSE all-gather +
    ReduceScatter merge (tests use it to reach that path with tiny models)."""
    return int_from_env("KVSHARD_FUSED_MERGE_MAX_BYTES", FUSED_MERGE_MAX_BYTES)


def query_heads(num_heads: int, parallel: ParallelState, replicate_q: bool) -> range:
    """The heads whose query this rank computes: its own, or those of its whole DCP group.

    DCP groups are contiguous slices of the TP ranks, so the group's heads are contiguous too.
    """
    per_rank = num_heads // parallel.tp_size
    if replicate_q:
        per_group = per_rank * parallel.dcp_size
        return range(parallel.dcp_group_index * per_group, (parallel.dcp_group_index + 1) * per_group)
    return range(parallel.tp_rank * per_rank, (parallel.tp_rank + 1) * per_rank)


class DCPAttention:
    """One layer's attention on one rank; the model gives it projected q, k, v and gets back
    the output of this rank's own heads, whether DCP is on or not."""

    def __init__(self, num_heads: int, scale: float, parallel: ParallelState) -> None:
        self.num_heads = num_heads  # this rank's query heads (H_l)
        self.scale = scale
        self.parallel = parallel
        self.fused_merge_max_bytes = fused_merge_max_bytes_from_env()

    def forward(
        self,
        q: torch.Tensor,  # [t, H_l, dk], or [t, N*H_l, dk] when q_spans_dcp_group
        k: torch.Tensor,  # [t, Hk, dk]
        v: torch.Tensor,  # [t, Hk, dv]
        cache: KVCacheLayer,
        meta: AttentionMetadata,
        q_spans_dcp_group: bool = False,
        value_map: Callable[[torch.Tensor], torch.Tensor] | None = None,
        chunk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention output [t, H_l, dv] of this rank's heads; [t, H_l, value_map(dv)] with value_map.

        `value_map` (linear, per head) is applied to the cached-context attention before the merge;
        `chunk` = (q [t, H_l, d], k [t, H_l, d], v [t, H_l, value_map(dv)]) then replaces q, k, v for
        the prefill chunks' attention to themselves: MLA attends to its cached latents in the absorbed
        form and, within a chunk, in the cheaper expanded form. The merge by LSE is exact across forms
        because both give the same scores.
        """
        state = self.parallel
        if meta.write_index.numel():
            cache.write(meta.write_slots, k[meta.write_index], v[meta.write_index])
        q_group = q
        if q_spans_dcp_group:
            q = q.unflatten(1, (state.dcp_size, self.num_heads))[:, state.dcp_rank]
        elif meta.uses_context and state.dcp_size > 1:
            q_group = dcp_all_gather(q, state).permute(1, 0, 2, 3).flatten(1, 2)  # [t, N*H_l, dk]
        out = lse = None
        if meta.uses_context:
            out, lse = self._attend_context(q_group, cache, meta)  # [t, N*H_l, dv], [t, N*H_l]
            out, lse = self._merge_over_group(out, lse)  # [t, H_l, dv], [t, H_l]
            if value_map is not None:  # in the model's dtype, as its weights; merged in float32
                out = value_map(out.to(q.dtype)).float()
        if meta.has_prefill:
            chunk_out, chunk_lse = self._attend_chunks(*(chunk if chunk is not None else (q, k, v)), meta)
            if out is None:
                out = chunk_out
            else:
                out, _ = merge_attention_states(torch.stack([out, chunk_out]), torch.stack([lse, chunk_lse]))
        return out.to(q.dtype)

    def _attend_chunks(self, q, k, v, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention inside each prefill chunk; decode rows stay empty (lse = -inf)."""
        out = q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]), dtype=torch.float32)
        lse = q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
        for group in meta.groups:
            if group.is_decode:
                continue
            rows = slice(group.start, group.end)
            o, l = attention_with_lse(q[rows][None], k[rows][None], v[rows][None], None, self.scale, causal=True)
            out[rows], lse[rows] = o[0], l[0]
        return out, lse

    def _attend_context(self, q, cache: KVCacheLayer, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        t, heads = q.shape[0], q.shape[1]
        out = q.new_zeros((t, heads, cache.value.shape[-1]), dtype=torch.float32)
        lse = q.new_full((t, heads), float("-inf"), dtype=torch.float32)
        for group in meta.groups:
            if group.context_blocks is None:  # this rank holds none of these requests' tokens yet
                continue
            rows = slice(group.start, group.end)
            keys, values = cache.gather(group.context_blocks, group.buffers)  # [g, L, Hk, dk], [g, L, Hk, dv]
            queries = q[rows].unflatten(0, (group.num_seqs, group.query_len))  # [g, s, H, dk]
            o, l = attention_with_lse(queries, keys, values, group.context_bias, self.scale)
            out[rows], lse[rows] = o.flatten(0, 1), l.flatten(0, 1)
        return out, lse

    def _merge_over_group(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum the group's partial attentions, weighted by LSE, and keep this rank's heads."""
        state = self.parallel
        if state.dcp_size == 1:
            return out, lse
        # batch-invariant mode: one path whatever the batch size (the sum runs locally, in rank order)
        if batch_invariant_active() or out.numel() * out.element_size() <= self.fused_merge_max_bytes:
            return self._merge_by_one_gather(out, lse)
        total = torch.logsumexp(dcp_all_gather(lse, state), dim=0)  # [t, N*H_l]
        scaled = out * lse_weights(lse, total).unsqueeze(-1)  # [t, N*H_l, dv]
        per_rank = scaled.unflatten(1, (state.dcp_size, self.num_heads)).transpose(0, 1)  # [N, t, H_l, dv]
        mine = dcp_reduce_scatter(per_rank, state)  # [t, H_l, dv]
        return mine, total.unflatten(1, (state.dcp_size, self.num_heads))[:, state.dcp_rank]

    def _merge_by_one_gather(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.parallel
        mine = slice(state.dcp_rank * self.num_heads, (state.dcp_rank + 1) * self.num_heads)
        packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1)  # [t, N*H_l, dv + 1]
        gathered = dcp_all_gather(packed, state)[:, :, mine]  # [N, t, H_l, dv + 1]
        return merge_attention_states(gathered[..., :-1], gathered[..., -1])
