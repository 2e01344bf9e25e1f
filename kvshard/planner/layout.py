"""Which attention layouts a model allows on tp ranks with DCP groups of dcp ranks.

DESIGN.md section 2: two tensor-parallel views of the same T ranks. The MLP, experts,
embeddings and LM head run TP over all T; attention runs with attention-TP degree
A = T / N over contiguous DCP groups of N ranks, each group holding its 1/A share of
the heads and splitting their KV along the sequence. Two ways to lay out a group:

- head-split: the query heads are split over all T ranks and gathered in the group
  (one Q all-gather per layer). Needs T to divide the query heads and, for GQA,
  N <= T / kv_heads, so that the ranks of a group already hold the same KV head.
- replicated: every rank of a group computes its group's Q (and GQA K/V, MLA W_UK):
  N times those projection weights per rank, one collective fewer per layer. Needs
  only A to divide the query heads and to divide, or be a multiple of, the KV heads.

Both end the same way: the merged output is reduce-scattered into 1/N feature slices
and the output projection is row-parallel over all T ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshard.planner.arch import ModelArch
from kvshard.planner.errors import PlanError

HEAD_SPLIT = "head-split"
REPLICATED = "replicated"


@dataclass(frozen=True)
class AttentionLayout:
    tp: int  # T: ranks of one model replica
    dcp: int  # N: ranks of one DCP group
    kind: str  # HEAD_SPLIT or REPLICATED (the same thing when dcp == 1)

    @property
    def attention_tp(self) -> int:
        """A = T / N: how many ways the attention heads are split."""
        return self.tp // self.dcp

    @property
    def replicates_projections(self) -> bool:
        return self.kind == REPLICATED and self.dcp > 1

    @property
    def label(self) -> str:
        base = f"tp={self.tp} dcp={self.dcp} A={self.attention_tp}"
        return base if self.dcp == 1 else f"{base} {self.kind}"

    def query_heads_per_rank(self, arch: ModelArch) -> float:
        """Query heads whose projection a rank computes."""
        return arch.num_heads / (self.attention_tp if self.replicates_projections else self.tp)

    def query_heads_per_group(self, arch: ModelArch) -> float:
        """Query heads a DCP group attends for (every rank of it, over its KV shard)."""
        return arch.num_heads / self.attention_tp

    def kv_heads_per_rank(self, arch: ModelArch) -> int:
        """KV heads whose cache a rank stores (one latent for MLA). A group holds its
        attention-TP share, at least one whole head: A above the KV heads replicates
        heads over groups."""
        return 1 if arch.is_mla else max(arch.num_kv_heads // self.attention_tp, 1)

    def projection_share(self, arch: ModelArch) -> tuple[float, float]:
        """Share of (query-side, GQA K/V) projection weights one rank holds."""
        ways = self.attention_tp if self.replicates_projections else self.tp
        kv_share = 0.0 if arch.is_mla else max(arch.num_kv_heads / ways, 1) / arch.num_kv_heads
        return 1 / ways, kv_share


def refusal(arch: ModelArch, layout: AttentionLayout) -> str | None:
    """Why this layout cannot run, or None if it can."""
    t, n, a, h, kv = layout.tp, layout.dcp, layout.attention_tp, arch.num_heads, arch.num_kv_heads
    if t % n:
        return f"dcp={n} does not divide tp={t}"
    if h % a:
        return f"attention-TP A = {t}/{n} = {a} does not divide the {h} query heads"
    if not arch.is_mla and kv % a and a % kv:
        return f"attention-TP A = {t}/{n} = {a} neither divides nor is a multiple of the {kv} KV heads"
    features = h // a * arch.attention_value_dim
    if features % n:
        return f"the {features} attention output features of a group do not split over dcp={n}"
    if layout.kind == HEAD_SPLIT and n > 1:
        if h % t:
            return f"head-split needs tp={t} to divide the {h} query heads"
        if not arch.is_mla and (t % kv or n > t // kv):
            return (f"head-split needs dcp <= tp/kv_heads = {t}/{kv}: the ranks of a group must already hold "
                    "the same KV head")
    return None


def layouts_for(tp: int, dcp: int) -> list[AttentionLayout]:
    """The layouts to consider for one (tp, dcp): one without DCP, two with it."""
    if dcp == 1:
        return [AttentionLayout(tp, 1, HEAD_SPLIT)]
    return [AttentionLayout(tp, dcp, HEAD_SPLIT), AttentionLayout(tp, dcp, REPLICATED)]


def check_tp(arch: ModelArch, num_gpus: int, tp: int) -> None:
    """Raise PlanError, saying what to change, for a tp that no dcp can fix."""
    if num_gpus < 1 or tp < 1:
        raise PlanError("--gpus and --tp must be at least 1")
    if num_gpus % tp:
        raise PlanError(f"--tp {tp} does not divide --gpus {num_gpus}: use a tp that divides the GPU count "
                        "(each tp-sized group serves one model replica)")
    mlp = {"MLP": arch.intermediate_size if arch.num_dense_mlp_layers else 0,
           "expert MLP": arch.moe_intermediate_size if arch.is_moe else 0}
    for what, size in mlp.items():
        if size % tp:
            raise PlanError(f"--tp {tp} does not divide the {what} width {size:,} of {arch.name}: the MLP runs TP "
                            "over all ranks, use a tp that divides it")


def split_layouts(arch: ModelArch, tp: int, dcps: list[int]) -> tuple[list[AttentionLayout],
                                                                     list[tuple[AttentionLayout, str]]]:
    """(valid layouts, refused layouts with the reason) for these DCP sizes."""
    valid, refused = [], []
    for dcp in dcps:
        for layout in layouts_for(tp, dcp):
            reason = refusal(arch, layout)
            if reason is None:
                valid.append(layout)
            else:
                refused.append((layout, reason))
    return valid, refused


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
