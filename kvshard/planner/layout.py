"""Which attention layouts a model allows on tp ranks with DCP groups of dcp ranks, as the planner asks.

The rules themselves, and what each layout costs a rank, live once in kvshard/config/layout_rules.py
(the engine's config asks the same module; tests/test_layout_rules.py checks that the two agree):
docs/design.md#parallel-layout. This module puts them in the planner's terms: an `AttentionLayout`
per (tp, dcp, kind), refusals worded with the planner's flags, and the planner's tp check.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshard.config import layout_rules as rules
from kvshard.config.layout_rules import HEAD_SPLIT, REPLICATED, AttentionShape
from kvshard.planner.arch import ModelArch
from kvshard.planner.errors import PlanError

__all__ = ["HEAD_SPLIT", "REPLICATED", "AttentionLayout", "attention_shape", "check_tp", "divisors", "layouts_for",
           "refusal", "split_layouts"]


def attention_shape(arch: ModelArch) -> AttentionShape:
    return AttentionShape(arch.num_heads, arch.num_kv_heads, arch.attention_value_dim, arch.is_mla)


@dataclass(frozen=True)
class AttentionLayout:
    tp: int  # T: ranks of one model replica
    dcp: int  # N: ranks of one DCP group
    kind: str  # HEAD_SPLIT or REPLICATED (the same thing when dcp == 1)

    @property
    def attention_tp(self) -> int:
        """A = T / N: how many ways the attention heads are split."""
        return rules.attention_tp_size(self.tp, self.dcp)

    @property
    def replicates_projections(self) -> bool:
        return rules.replicates_projections(self.dcp, self.kind)

    @property
    def label(self) -> str:
        base = f"tp={self.tp} dcp={self.dcp} A={self.attention_tp}"
        return base if self.dcp == 1 else f"{base} {self.kind}"

    def query_heads_per_rank(self, arch: ModelArch) -> float:
        """Query heads whose projection a rank computes."""
        return rules.query_heads_per_rank(attention_shape(arch), self.tp, self.dcp, self.kind)

    def query_heads_per_group(self, arch: ModelArch) -> float:
        """Query heads a DCP group attends for (every rank of it, over its KV shard)."""
        return rules.query_heads_per_group(attention_shape(arch), self.tp, self.dcp)

    def kv_heads_per_rank(self, arch: ModelArch) -> int:
        """KV heads whose cache a rank stores (one latent for MLA). A group holds its
        attention-TP share, at least one whole head: A above the KV heads replicates
        heads over groups."""
        return rules.kv_heads_per_rank(attention_shape(arch), self.tp, self.dcp)

    def projection_share(self, arch: ModelArch) -> tuple[float, float]:
        """Share of (query-side, GQA K/V) projection weights one rank holds."""
        ways = self.attention_tp if self.replicates_projections else self.tp
        kv_share = 0.0 if arch.is_mla else max(arch.num_kv_heads / ways, 1) / arch.num_kv_heads
        return 1 / ways, kv_share


def refusal(arch: ModelArch, layout: AttentionLayout) -> str | None:
    """Why this layout cannot run, or None if it can."""
    reason = rules.layout_refusal(attention_shape(arch), layout.tp, layout.dcp, layout.kind)
    return None if reason is None else reason.planner_message()


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
