"""The DCP decode rhythm (docs/design.md#one-decode-step-of-attention), one call per attention layer.

A DCP group of N ranks attends for its 1/A share of the heads (A = tp / N) and
splits their KV along the sequence. First every rank writes the new tokens it
owns into its cache. Then:

  (a) cached context, sharded over the group (for a decode this includes its
      new token): the group's queries (all-gathered in the head-split layout,
      computed by every rank in the replicated one) -> attention of all of them
      over the local shard, with LSE -> AllGather LSE, rescale, ReduceScatter
      hands each rank 1/N of the output features;
  (b) for prefill chunks only: causal attention over the chunk's own K/V
      (every rank of the group computed them), for the heads of those features;
  and (a) and (b) are merged by LSE. With dcp = 1 the collectives are
  identities and this is ordinary paged attention.

The write, (a) over the local shard and (b) are the step's attention backend's
(attention/backends.py, `meta.backend`: the paged kernel, gather + flash, or the
reference); the rhythm around them is the same for all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvshard.attention.fused_ops import flatten_heads, merge_states
from kvshard.attention.merge import lse_weights
from kvshard.attention.metadata import AttentionMetadata
from kvshard.attention.paged import empty_packed, packed_of
from kvshard.attention.timing import DCP_TIMES, DcpTimes
from kvshard import envs
from kvshard.kv.cache import KVCacheLayer
from kvshard.layers.batch_invariant import batch_invariant_active
from kvshard.parallel import AttentionHeads, ParallelState, dcp_all_gather, dcp_all_to_all, dcp_reduce_scatter

# Below this many bytes of partial output per rank, a merge costs its collectives' latency, not
# their bandwidth: one all-gather of [output | lse] replaces the LSE all-gather + ReduceScatter
# pair, at the price of moving every head instead of one rank's share.
FUSED_MERGE_MAX_BYTES = envs.env("KVSHARD_FUSED_MERGE_MAX_BYTES").default  # 256 KiB
# --dcp-comm-backend auto takes the all-to-all up to this many bytes of partial output per rank
# (KVSHARD_A2A_MAX_BYTES overrides; 0 is always ag_rs). Measured over shared memory at dcp=2 on a
# shared 2-core CPU (medians of 50, two runs): a tie with both ag_rs forms at 64 KiB, the
# all-to-all 1.3-3x faster from 1 to 8 MiB, 16 MiB split between runs; above is unmeasured.
A2A_MAX_BYTES = envs.env("KVSHARD_A2A_MAX_BYTES").default  # 16 MiB
AG_RS, AG_RS_FUSED, A2A = "ag_rs", "ag_rs fused", "a2a"  # the merge schemes, named as the planner's
# MLA's long chunks expand their cached latents into per-head keys and values in pieces of at most this many bytes
# (DeepSeek-V3's 128 heads in bfloat16: 80 KiB a token, some 800 tokens a piece), merged by LSE: a long context's
# whole expansion would take gigabytes. KVSHARD_MLA_EXPANDED_PIECE_BYTES overrides (the same on every rank).
EXPANDED_PIECE_BYTES = envs.env("KVSHARD_MLA_EXPANDED_PIECE_BYTES").default  # 64 MiB


@dataclass(frozen=True)
class ExpandedContext:
    """MLA's cached context in the expanded form, for the long chunks (DeepseekV2MLAAttention).

    In the absorbed form each (row, cached token, head) costs c + r channels of scores and c of
    values; expanded, n + r and v, after each cached token is up-projected once per head (c (n + v)
    multiply-adds): cheaper for a chunk of at least `min_rows` rows. The cache holds latents either way.
    """

    min_rows: int  # a chunk after cached context with at least this many rows takes this form
    value_dim: int  # v, the channels of an expanded value
    # rows -> [R, H/A, n + r]: those rows' queries for the group's heads, not absorbed
    queries: Callable[[slice], torch.Tensor]
    # latents [L, c + r] (the cache's rows, in the model's dtype) -> keys [L, H/A, n + r], values [L, H/A, v]
    keys_values: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def fused_merge_max_bytes_from_env() -> int:
    """FUSED_MERGE_MAX_BYTES, or KVSHARD_FUSED_MERGE_MAX_BYTES: 0 always takes the LSE all-gather +
    ReduceScatter merge (tests use it to reach that path with tiny models)."""
    return envs.get("KVSHARD_FUSED_MERGE_MAX_BYTES")


class Attention:
    """One layer's attention on one rank, DCP or not: models see only this.

    The model gives it q of `heads.query`, k and v of `heads.kv` (ParallelState.attention_heads)
    and gets back this rank's 1/N share of its DCP group's output features, [t, H/A * dv / N]:
    the input slice of an output projection that is row-parallel over all T ranks. With
    head-split that share is the rank's own heads; otherwise it may end inside a head.
    """

    def __init__(self, heads: AttentionHeads, scale: float, parallel: ParallelState) -> None:
        self.heads = heads
        self.scale = scale
        self.parallel = parallel
        self.fused_merge_max_bytes = fused_merge_max_bytes_from_env()
        self.expanded_piece_bytes = envs.get("KVSHARD_MLA_EXPANDED_PIECE_BYTES")
        self.a2a_max_bytes = envs.get("KVSHARD_A2A_MAX_BYTES")
        # where the output heads sit among the group's heads and among the computed queries
        self._output_in_group = _relative(heads.output, heads.group)
        # every DCP rank's output heads among the group's: what the all-to-all sends each of them
        group_start = parallel.dcp_group_index * parallel.dcp_size
        self._output_in_group_of_rank = [
            _relative(replace(parallel, rank=group_start + r, dcp_rank=r).attention_heads(
                heads.num_heads, heads.num_kv_heads).output, heads.group) for r in range(parallel.dcp_size)]
        self._output_in_query = _relative(heads.output, heads.query)
        self._output_kv = self._kv_heads_of(heads.output)
        self._whole_heads = len(heads.group) % parallel.dcp_size == 0  # each rank's share is whole heads

    def forward(
        self,
        q: torch.Tensor,  # [t, Hq, dk]: the heads.query heads
        k: torch.Tensor,  # [t, Hk, dk]
        v: torch.Tensor,  # [t, Hk, dv]
        cache: KVCacheLayer,
        meta: AttentionMetadata,
        value_map: Callable[[torch.Tensor], torch.Tensor] | None = None,
        chunk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        expanded: ExpandedContext | None = None,
    ) -> torch.Tensor:
        """This rank's output features [t, H/A * dv / N] (dv after value_map, with value_map).

        Only the first `meta.context_rows` rows of q attend to cached context; with `chunk`, q may
        hold those rows alone.

        `value_map` (linear, per head) is applied to the cached-context attention before the merge;
        `chunk` = (q, k, v) of the output heads ([t, H_o, d], [t, H_o, d], [t, H_o, value_map(dv)])
        then replaces q, k, v for the prefill chunks' attention to themselves: MLA attends to its
        cached latents in the absorbed form and, within a chunk, in the cheaper expanded form. The
        merge by LSE is exact across forms because both give the same scores.

        `expanded` (with `value_map`) reads the cached context of chunks of at least `expanded.min_rows`
        rows in the expanded form too; their rows leave the absorbed call empty and are merged apart
        (`_context_in_both_forms`).
        """
        state = self.parallel
        meta.backend.write(cache, meta, k, v)
        out = lse = None  # over the output heads, for the context rows: [c, H_o, dv], [c, H_o]
        if meta.uses_context:
            times = DCP_TIMES if DCP_TIMES.enabled and state.dcp_size > 1 else None
            start = time.perf_counter() if times else 0.0
            long = self._expanded_groups(meta, expanded, value_map)
            if long:
                out, lse = self._context_in_both_forms(q[: meta.context_rows], cache, meta, value_map, expanded, long,
                                                       times, start)
            else:
                q_group = q[: meta.context_rows]  # [c, Hq, dk]
                if self.heads.gathers_queries:
                    q_group = dcp_all_gather(q_group, state).permute(1, 0, 2, 3).flatten(1, 2)  # [c, H/A, dk]
                    start = times.add("collective", start) if times else start
                packed = self._attend_context(q_group, cache, meta)  # [c, H/A, dv + 1]
                start = times.add("attention", start) if times else start
                # a value map needs whole heads' merged latents: a share ending inside a head gathers them all
                out, lse = self._merge_over_group(packed, whole_heads=value_map is not None,
                                                  times=times, start=start)  # [c, H_o, dv], [c, H_o]
                if value_map is not None:  # in the model's dtype, as its weights; merged in float32
                    out = value_map(out.to(q.dtype)).float()
        if meta.has_prefill:
            if chunk is None:  # the chunk's K/V as the cache holds them (FP8: rounded), as later steps read them
                chunk = (q[:, self._output_in_query], *cache.as_read(k[:, self._output_kv], v[:, self._output_kv]))
            chunk_out, chunk_lse = self._attend_chunks(*chunk, meta)  # [t, H_o, dv], [t, H_o]
            if out is not None:  # rows past the context rows have the chunk's attention alone
                c = out.shape[0]
                merged, _ = merge_states([out, chunk_out[:c]], [lse, chunk_lse[:c]])
                chunk_out[:c] = merged
            out = chunk_out
        if self._whole_heads:  # converted in one pass: `out` is often a view of the kernel's packed [o | lse]
            return flatten_heads(out, q.dtype)
        return out.flatten(1)[:, self._share(out.shape[-1])].to(q.dtype)  # [t, H/A * dv / N]

    def _expanded_groups(self, meta: AttentionMetadata, expanded: ExpandedContext | None,
                         value_map) -> list:
        """The chunks after cached context that read it in the expanded form: every rank picks the same ones
        (row counts are global). None in the batch-invariant mode (whether a chunk is long depends on the batch)."""
        if expanded is None or value_map is None or batch_invariant_active():
            return []
        return [g for g in meta.groups
                if g.attends_itself and g.start < meta.context_rows and g.query_len >= expanded.min_rows]

    def _context_in_both_forms(self, q_context, cache: KVCacheLayer, meta: AttentionMetadata, value_map,
                               expanded: ExpandedContext, long: list, times: DcpTimes | None = None,
                               start: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The context rows' attention [c, H_o, v], [c, H_o] from q_context [c, Hq, dk]: the long chunks' rows in
        the expanded form, the others absorbed (merged over the group by LSE, then through the value map).

        Where the rank computes its group's queries (replicated, or no DCP), a long chunk's rows attend over the
        request's cached latents on this rank, up-projected for the group's heads, and are merged over the group
        apart. In the head-split layout the group instead all-gathers the request's latents, and each rank
        attends with its own heads' queries over all of them: no merge, and no up-projection weights beyond its
        own heads'. With `times`, as Attention.forward's absorbed path records them (the latents' gathers count as
        attention)."""
        state = self.parallel
        c = meta.context_rows
        in_long = torch.zeros(c, dtype=torch.bool)
        for group in long:
            in_long[group.start:group.end] = True
        absorbed_rows = (~in_long).nonzero().squeeze(1).to(q_context.device)
        long_rows = in_long.nonzero().squeeze(1).to(q_context.device)
        out = lse = None
        if absorbed_rows.numel():
            q_group = q_context
            if self.heads.gathers_queries:  # the absorbed rows' queries only, in their places (the others stay 0)
                gathered = dcp_all_gather(q_context[absorbed_rows], state).permute(1, 0, 2, 3).flatten(1, 2)
                start = times.add("collective", start) if times else start
                q_group = gathered.new_zeros(c, *gathered.shape[1:])
                q_group[absorbed_rows] = gathered  # [c, H/A, dk]
            # the long chunks' rows see no token in the absorbed call (the kernel skips them; the gather backend's
            # groups leave them out), and their rows stay out of its merge
            row_lens = meta.row_lens.clone()
            row_lens[long_rows] = 0
            absorbed = replace(meta, groups=[g for g in meta.groups if not any(g is x for x in long)],
                               row_lens=row_lens)
            packed = self._attend_context(q_group, cache, absorbed)[absorbed_rows]  # [a, H/A, c + 1]
            start = times.add("attention", start) if times else start
            o, l = self._merge_over_group(packed, whole_heads=True, times=times, start=start)
            start = time.perf_counter() if times else start
            o = value_map(o.to(q_context.dtype)).float()  # [a, H_o, v]
            out = o.new_zeros(c, *o.shape[1:])
            lse = l.new_full((c, l.shape[1]), float("-inf"))
            out[absorbed_rows], lse[absorbed_rows] = o, l
        parts = []
        for group in long:
            queries = expanded.queries(slice(group.start, group.end))  # [R, Hq, n + r]
            local = int(group.local_lens[0])  # this rank's cached tokens of the request (0 on a rank holding none)
            if self.heads.gathers_queries:  # the whole request's latents, gathered piece by piece
                pieces = self._group_pieces(queries, cache, group, local, expanded)
            else:
                piece = self._piece_tokens(queries, expanded, cache.block_size, 1)
                pieces = (_local_latents(cache, group, first, min(piece, local - first))
                          for first in range(0, local, piece))
            parts.append(packed_of(*self._expanded_attention(queries, pieces, expanded, meta)))
        packed = torch.cat(parts)  # [e, Hq, v + 1]
        start = times.add("attention", start) if times else start
        if self.heads.gathers_queries:  # each rank's own heads over every token: nothing to merge
            o, l = packed[..., :-1], packed[..., -1]
        else:
            o, l = self._merge_over_group(packed, times=times, start=start)  # [e, H_o, v], [e, H_o]
        if out is None:
            out = o.new_zeros(c, *o.shape[1:])
            lse = l.new_full((c, l.shape[1]), float("-inf"))
        out[long_rows], lse[long_rows] = o, l
        return out, lse

    def _piece_tokens(self, queries, expanded: ExpandedContext, block_size: int, ranks: int) -> int:
        """Tokens of each rank's share a piece takes: whole blocks, the keys and values of `ranks` such shares
        within KVSHARD_MLA_EXPANDED_PIECE_BYTES (the same on every rank: in head-split the pieces are collectives)."""
        per_token = queries.shape[1] * (queries.shape[-1] + expanded.value_dim) * queries.element_size()
        return max(block_size, self.expanded_piece_bytes // (per_token * ranks) // block_size * block_size)

    def _group_pieces(self, queries, cache: KVCacheLayer, group, local: int, expanded: ExpandedContext):
        """Head-split: every cached latent of the request, the group's shares all-gathered piece by piece (first
        the counts, then each piece of every rank's share, padded to the longest): [n, c + r] a piece. Attention
        does not depend on the order of its keys (their positions are in them), so the shares are joined rank by
        rank."""
        state = self.parallel
        counts = dcp_all_gather(torch.tensor([float(local)]), state)[:, 0].long().tolist()
        longest, width = max(counts), cache.key.shape[-1]
        piece = self._piece_tokens(queries, expanded, cache.block_size, len(counts))
        for first in range(0, longest, piece):
            n = min(piece, longest - first)
            mine = torch.zeros(n, width, dtype=queries.dtype, device=cache.key.device)
            have = min(n, max(0, local - first))
            if have:
                mine[:have] = _local_latents(cache, group, first, have)
            shares = dcp_all_gather(mine, state)  # [N, n, c + r]
            yield torch.cat([shares[r, :min(n, count - first)] for r, count in enumerate(counts) if count > first])

    def _expanded_attention(self, queries, pieces, expanded: ExpandedContext,
                            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [R, Hq, n + r] over cached latents given in pieces ([n, c + r] each), each piece up-projected and
        attended, the pieces merged by LSE: o [R, Hq, v], lse [R, Hq]; no latent: o = 0, lse = -inf."""
        outs, lses = [], []
        for latents in pieces:
            keys, values = expanded.keys_values(latents.to(queries.dtype))
            o, l = meta.backend.attend_keys(queries, keys, values, self.scale)
            outs.append(o)
            lses.append(l)
        if not outs:
            return empty_packed(queries.shape[0], queries.shape[1], expanded.value_dim, queries.device)
        if len(outs) == 1:
            return outs[0], lses[0]
        return merge_states(outs, lses)

    def _kv_heads_of(self, query_heads: range) -> slice | torch.Tensor:
        """The KV heads (among heads.kv) the given query heads read: a slice when the kernel's
        grouping (query i reads KV i // (Hq / Hk)) holds, else one index per query head."""
        per = self.heads.heads_per_kv_head
        kv_of = [h // per - self.heads.kv.start for h in query_heads]
        touched = kv_of[-1] - kv_of[0] + 1
        if len(kv_of) % touched == 0:
            group = len(kv_of) // touched
            if all(kv == kv_of[0] + i // group for i, kv in enumerate(kv_of)):
                return slice(kv_of[0], kv_of[-1] + 1)
        return torch.tensor(kv_of)

    def _share(self, dv: int) -> slice:
        """This rank's 1/N of the group's output features, within the output heads' features."""
        width = len(self.heads.group) * dv // self.parallel.dcp_size
        start = self.parallel.dcp_rank * width - self._output_in_group.start * dv
        return slice(start, start + width)

    def _attend_chunks(self, q, k, v, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention inside each prefill chunk that attends to itself; other rows stay empty (lse = -inf)."""
        return meta.backend.attend_chunks(q, k, v, meta, self.scale)

    def _attend_context(self, q, cache: KVCacheLayer, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q [t, H/A, dk] over this rank's shard: [output | lse], [t, H/A, dv + 1]
        (side by side so the merge sends them without a packing copy)."""
        out, lse = meta.backend.attend_context(q, cache, meta, self.scale)  # [t, H/A, dv], [t, H/A]
        return packed_of(out, lse)

    def _merge_over_group(self, packed: torch.Tensor, whole_heads: bool = False,
                          times: DcpTimes | None = None, start: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum the group's partial attentions [output | lse] [t, H/A, dv + 1], weighted by LSE, and keep this rank's
        share of the features, in its output heads [t, H_o, dv] (features of a head at either end
        that belong to a neighbour are left zero, unless `whole_heads` or the scheme gives them).
        With `times`, the time since `start` goes to "merge" and the collectives' to "collective"."""
        state = self.parallel
        out, lse = packed[..., :-1], packed[..., -1]  # [t, H/A, dv], [t, H/A]
        if state.dcp_size == 1:
            return out, lse
        # batch-invariant mode: one scheme whatever the batch size (the sum runs locally, in rank order)
        scheme = AG_RS_FUSED if batch_invariant_active() else merge_scheme(
            state.dcp_comm_backend, out.numel() * out.element_size(), self.fused_merge_max_bytes,
            self.a2a_max_bytes, whole_heads and not self._whole_heads)

        def timed(collective: Callable[..., torch.Tensor], *args) -> torch.Tensor:
            nonlocal start
            if times is None:
                return collective(*args, state)
            start = times.add("merge", start)
            result = collective(*args, state)
            start = times.add("collective", start)
            return result

        if scheme == AG_RS:
            total = torch.logsumexp(timed(dcp_all_gather, lse), dim=0)  # [t, H/A]
            scaled = out * lse_weights(lse, total).unsqueeze(-1)  # [t, H/A, dv]
            t, heads, dv = out.shape
            per_rank = scaled.flatten(1).unflatten(1, (state.dcp_size, -1)).transpose(0, 1)  # [N, t, H/A*dv/N]
            mine = timed(dcp_reduce_scatter, per_rank)  # [t, H/A*dv/N]
            if not self._whole_heads:
                padded = mine.new_zeros(t, len(self.heads.output) * dv)
                padded[:, self._share(dv)] = mine
                mine = padded
            merged = mine.unflatten(1, (-1, dv)), total[:, self._output_in_group]
        else:
            if scheme == A2A:  # each rank gets its output heads' partials from every rank
                parts = timed(dcp_all_to_all, [packed[:, heads] for heads in self._output_in_group_of_rank])
            else:
                parts = timed(dcp_all_gather, packed)[:, :, self._output_in_group]
            merged = merge_states(parts[..., :-1], parts[..., -1])  # from [N, t, H_o, dv + 1]
        if times is not None:
            times.add("merge", start)
            times.merges[scheme] += 1
        return merged


def _local_latents(cache: KVCacheLayer, group, first: int, n: int) -> torch.Tensor:
    """[n, c + r]: this rank's cached latents first..first + n of a chunk group's request, in the compute dtype (its
    blocks copied into the group's buffers, which the step's layers reuse)."""
    b = cache.block_size
    blocks = group.context_blocks[:1, first // b: -(-(first + n) // b)]  # [1, nb]
    start = first % b
    return cache.gather(blocks, group.buffers)[0][0, start:start + n, 0]


def merge_scheme(backend: str, output_bytes: int, fused_max_bytes: int, a2a_max_bytes: int,
                 needs_whole_heads: bool) -> str:
    """How a DCP group merges one layer's partial attentions of `output_bytes` per rank.

    ag_rs: the LSE all-gather + ReduceScatter pair, or one all-gather of [output | lse] when the
    output is small (latency-bound) or a value map needs whole heads; a2a: always one all-to-all;
    auto: a2a up to `a2a_max_bytes`, ag_rs above. The result depends on sizes alone, so every
    rank of a group picks the same scheme.
    """
    if backend == A2A or (backend == "auto" and output_bytes <= a2a_max_bytes):
        return A2A
    if output_bytes <= fused_max_bytes or needs_whole_heads:
        return AG_RS_FUSED
    return AG_RS


def _relative(inner: range, outer: range) -> slice:
    return slice(inner.start - outer.start, inner.stop - outer.start)
