"""Which attention layouts run a model on tp ranks in DCP groups of dcp ranks, and what each costs.

The one home of these rules: the engine's config (kvshard/config/layout.py) and the planner
(kvshard/planner/layout.py) both ask this module; it imports nothing but the standard library
(the planner runs without torch). docs/design.md#parallel-layout explains the picture:

Two tensor-parallel views of the same T ranks. The MLP, experts, embeddings and LM head run TP
over all T; attention runs with attention-TP degree A = T / N over contiguous DCP groups of N
ranks (so there are A groups), each group holding its 1/A share of the heads and splitting their
KV along the sequence. Two ways to lay out a group:

- head-split: the query heads are split over all T ranks and gathered in the group (one Q
  all-gather per layer). Needs T to divide the query heads and, for GQA, the ranks of a group to
  hold the same KV head already: A a multiple of the KV heads (N divides T / kv_heads, which, given
  the rule below, is N <= T / kv_heads).
- replicated: every rank of a group computes its group's Q (and GQA K/V, MLA W_UK and W_UV): N times those
  projection weights per rank, one collective fewer per layer. Needs only A to divide the query
  heads and to divide, or be a multiple of, the KV heads.

Both end the same way: the merged output is reduce-scattered into 1/N feature slices and the
output projection is row-parallel over all T ranks, so the group's output features must split
over N (equivalently, all output features over T).
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD_SPLIT = "head-split"  # query heads split over all T ranks, gathered in the group: one collective more
REPLICATED = "replicated"  # every rank computes its group's queries: N x the query-side projection weights
LAYOUTS = (HEAD_SPLIT, REPLICATED)
ATTENTION_LAYOUTS = ("auto", *LAYOUTS)  # what --dcp-attention-layout takes


@dataclass(frozen=True)
class AttentionShape:
    """What the rules need to know of a model's attention."""

    num_heads: int  # query heads
    num_kv_heads: int  # GQA KV heads (MLA: any; its latent is one shared "KV head")
    value_dim: int  # features of one head's attention output
    is_mla: bool = False

    @property
    def cache_kv_heads(self) -> int:
        """KV heads as the cache sees them: MLA has one shared latent."""
        return 1 if self.is_mla else self.num_kv_heads


def attention_tp_size(tp: int, dcp: int) -> int:
    """A = T / N: the ways attention heads are split, which is also the number of DCP groups."""
    return tp // dcp


@dataclass(frozen=True)
class Refusal:
    """A rule a (tp, dcp, layout) breaks, worded for the engine's flags or the planner's."""

    rule: str  # "dcp-divides-tp", "heads", "kv-heads", "features", "head-split-heads", "head-split-kv"
    tp: int
    dcp: int
    shape: AttentionShape

    def engine_message(self) -> str:
        t, n, s = self.tp, self.dcp, self.shape
        if self.rule == "dcp-divides-tp":
            return f"decode_context_parallel_size={n} does not divide tensor_parallel_size={t}"
        a = attention_tp_size(t, n)
        if self.rule == "heads":
            return f"attention-TP A = tp/dcp = {t}/{n} = {a} does not divide the model's {s.num_heads} query heads"
        if self.rule == "kv-heads":
            return (f"attention-TP A = tp/dcp = {a} neither divides nor is a multiple of the model's "
                    f"{s.cache_kv_heads} KV heads")
        if self.rule == "features":
            return f"the {s.num_heads * s.value_dim} attention output features do not split over tp={t}"
        if self.rule == "head-split-heads":
            return f"head-split needs tensor_parallel_size={t} to divide the {s.num_heads} query heads"
        return (f"head-split needs the ranks of a DCP group to hold the same single KV head "
                f"(dcp <= tp / num_kv_heads = {t}/{s.cache_kv_heads})")

    def planner_message(self) -> str:
        t, n, s, kv = self.tp, self.dcp, self.shape, self.shape.cache_kv_heads
        if self.rule == "dcp-divides-tp":
            return f"dcp={n} does not divide tp={t}"
        a = attention_tp_size(t, n)
        if self.rule == "heads":
            return f"attention-TP A = {t}/{n} = {a} does not divide the {s.num_heads} query heads"
        if self.rule == "kv-heads":
            return f"attention-TP A = {t}/{n} = {a} neither divides nor is a multiple of the {kv} KV heads"
        if self.rule == "features":
            return f"the {s.num_heads // a * s.value_dim} attention output features of a group do not split over dcp={n}"
        if self.rule == "head-split-heads":
            return f"head-split needs tp={t} to divide the {s.num_heads} query heads"
        return f"head-split needs dcp <= tp/kv_heads = {t}/{kv}: the ranks of a group must already hold the same KV head"


def attention_refusal(shape: AttentionShape, tp: int, dcp: int) -> Refusal | None:
    """The rule that no layout of attention can meet at this (tp, dcp), or None."""
    if tp < 1 or dcp < 1 or tp % dcp:
        return Refusal("dcp-divides-tp", tp, dcp, shape)
    a, kv = attention_tp_size(tp, dcp), shape.cache_kv_heads
    if shape.num_heads % a:
        return Refusal("heads", tp, dcp, shape)
    if kv % a and a % kv:
        return Refusal("kv-heads", tp, dcp, shape)
    if shape.num_heads * shape.value_dim % tp:  # a group's features over N, given A divides the heads
        return Refusal("features", tp, dcp, shape)
    return None


def head_split_refusal(shape: AttentionShape, tp: int, dcp: int) -> Refusal | None:
    """The rule head-split breaks where attention_refusal is None, or None (at dcp = 1 it always applies)."""
    if dcp == 1:
        return None
    if shape.num_heads % tp:
        return Refusal("head-split-heads", tp, dcp, shape)
    if attention_tp_size(tp, dcp) % shape.cache_kv_heads:
        return Refusal("head-split-kv", tp, dcp, shape)
    return None


def layout_refusal(shape: AttentionShape, tp: int, dcp: int, layout: str) -> Refusal | None:
    """Why this resolved layout (HEAD_SPLIT or REPLICATED) cannot run, or None if it can."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {', '.join(LAYOUTS)}")
    reason = attention_refusal(shape, tp, dcp)
    if reason is None and layout == HEAD_SPLIT:
        reason = head_split_refusal(shape, tp, dcp)
    return reason


def valid_layouts(shape: AttentionShape, tp: int, dcp: int) -> list[str]:
    """The layouts that run at (tp, dcp): at dcp = 1 both names are the same thing, HEAD_SPLIT."""
    candidates = [HEAD_SPLIT] if dcp == 1 else list(LAYOUTS)
    return [layout for layout in candidates if layout_refusal(shape, tp, dcp, layout) is None]


# --- what a layout costs a rank ---------------------------------------------------------------------

def replicates_projections(dcp: int, layout: str) -> bool:
    return layout == REPLICATED and dcp > 1


def query_heads_per_rank(shape: AttentionShape, tp: int, dcp: int, layout: str) -> float:
    """Query heads whose projection one rank computes: its 1/T share (head-split) or its group's 1/A."""
    ways = attention_tp_size(tp, dcp) if replicates_projections(dcp, layout) else tp
    return shape.num_heads / ways


def query_heads_per_group(shape: AttentionShape, tp: int, dcp: int) -> float:
    """Query heads a DCP group attends for (every rank of it, over its KV shard)."""
    return shape.num_heads / attention_tp_size(tp, dcp)


def kv_heads_per_rank(shape: AttentionShape, tp: int, dcp: int) -> int:
    """KV heads whose cache one rank stores: its group's 1/A share, at least one whole head (one latent for MLA)."""
    return max(shape.cache_kv_heads // attention_tp_size(tp, dcp), 1)


def kv_copies_per_token(shape: AttentionShape, tp: int, dcp: int) -> int:
    """How many ranks store the same K/V of a token: the DCP groups holding one KV head (A / kv_heads when
    attention-TP exceeds the KV heads); a group stores it once."""
    return max(1, attention_tp_size(tp, dcp) // shape.cache_kv_heads)
