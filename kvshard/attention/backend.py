"""The DCP decode rhythm (DESIGN.md section 4), one call per attention layer.

New tokens attend to (a) the context already cached, sharded over the DCP
group, and (b) each other, causally; the two parts are merged by LSE:

  (a) AllGather Q over the group -> attention of all gathered heads over the
      local shard, with LSE -> AllGather LSE, rescale, ReduceScatter the heads
      back to their rank.
  (b) local causal attention over the new tokens' own K/V (every rank of the
      group computed them), for this rank's heads only.

Then each rank writes the new tokens it owns into its cache. With dcp = 1 the
collectives are identities and this is ordinary paged attention.
"""

from __future__ import annotations

import torch

from kvshard.attention.merge import attention_with_lse, lse_weights, merge_attention_states
from kvshard.attention.metadata import AttentionMetadata
from kvshard.parallel import ParallelState, dcp_all_gather, dcp_reduce_scatter


class KVCacheLayer:
    """One layer's cache on one rank: key [slots, Hk, dk] and value [slots, Hk, dv].

    The value may be a view into the key (MLA keeps [c_kv | k_pe] and reads c_kv as V),
    in which case only the key is written.
    """

    def __init__(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.key = key
        self.value = value
        self.value_is_view = value.data_ptr() == key.data_ptr()

    def write(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        self.key.index_copy_(0, slots, key.to(self.key.dtype))
        if not self.value_is_view:
            self.value.index_copy_(0, slots, value.to(self.value.dtype))


class DCPAttention:
    def __init__(self, num_heads: int, scale: float, parallel: ParallelState) -> None:
        self.num_heads = num_heads  # this rank's query heads (H_l)
        self.scale = scale
        self.parallel = parallel

    def forward(
        self,
        q: torch.Tensor,  # [t, H_l, dk], or [t, N*H_l, dk] when q_spans_dcp_group
        k: torch.Tensor,  # [t, Hk, dk]
        v: torch.Tensor,  # [t, Hk, dv]
        cache: KVCacheLayer,
        meta: AttentionMetadata,
        q_spans_dcp_group: bool = False,
    ) -> torch.Tensor:
        state = self.parallel
        if q_spans_dcp_group:
            q_group = q
            q = q.unflatten(1, (state.dcp_size, self.num_heads))[:, state.dcp_rank]
        out, lse = self._attend_new(q, k, v, meta)
        if meta.has_context:
            if not q_spans_dcp_group:
                q_group = dcp_all_gather(q, state).permute(1, 0, 2, 3).flatten(1, 2)  # [t, N*H_l, dk]
            ctx_out, ctx_lse = self._attend_context(q_group, cache, meta)  # [t, N*H_l, dv], [t, N*H_l]
            ctx_out, ctx_lse = self._merge_over_group(ctx_out, ctx_lse)  # [t, H_l, dv], [t, H_l]
            out, _ = merge_attention_states(torch.stack([out, ctx_out]), torch.stack([lse, ctx_lse]))
        if meta.write_index.numel():
            cache.write(meta.write_slots, k[meta.write_index], v[meta.write_index])
        return out.to(q.dtype)

    def _attend_new(self, q, k, v, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        t = q.shape[0]
        out = q.new_empty((t, q.shape[1], v.shape[-1]), dtype=torch.float32)
        lse = q.new_empty((t, q.shape[1]), dtype=torch.float32)
        for group in meta.groups:
            idx = group.token_index  # [g, s]
            o, l = attention_with_lse(q[idx], k[idx], v[idx], group.new_mask, self.scale)
            out[idx] = o
            lse[idx] = l
        return out, lse

    def _attend_context(self, q, cache: KVCacheLayer, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        t, heads = q.shape[0], q.shape[1]
        out = q.new_zeros((t, heads, cache.value.shape[-1]), dtype=torch.float32)
        lse = q.new_full((t, heads), float("-inf"), dtype=torch.float32)
        for group in meta.groups:
            if group.context_slots is None:  # this rank holds none of these requests' tokens yet
                continue
            idx = group.token_index
            keys = cache.key[group.context_slots]  # [g, Lc, Hk, dk]
            values = cache.value[group.context_slots]  # [g, Lc, Hk, dv]
            o, l = attention_with_lse(q[idx], keys, values, group.context_mask, self.scale)
            out[idx] = o
            lse[idx] = l
        return out, lse

    def _merge_over_group(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum the group's partial attentions, weighted by LSE, and keep this rank's heads."""
        state = self.parallel
        if state.dcp_size == 1:
            return out, lse
        total = torch.logsumexp(dcp_all_gather(lse, state), dim=0)  # [t, N*H_l]
        scaled = out * lse_weights(lse, total).unsqueeze(-1)  # [t, N*H_l, dv]
        per_rank = scaled.unflatten(1, (state.dcp_size, self.num_heads)).transpose(0, 1)  # [N, t, H_l, dv]
        mine = dcp_reduce_scatter(per_rank, state)  # [t, H_l, dv]
        return mine, total.unflatten(1, (state.dcp_size, self.num_heads))[:, state.dcp_rank]
