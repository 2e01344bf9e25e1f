"""The seed article's experiment, to set the planner's predictions beside it.

Published (vLLM blog, 2026-08-07, quoted by the seed article): 8x B200, Kimi K2.6,
agentic workload. TP=8 plateaus at concurrency ~64 with the KV cache full and
~1,863 tok/s/GPU; with DCP the engine reaches concurrency 512 at 82% KV use and
~6,091 tok/s/GPU (3.3x). An 8x jump in concurrency needs dcp=8 on that node (dcp=2
can at most double KV capacity), so the DCP side is compared with dcp=8, in vLLM's
layout (query heads split over the TP ranks) and merge (all-gather + reduce-scatter).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvshard.planner.errors import PlanError
from kvshard.planner.layout import HEAD_SPLIT
from kvshard.planner.plan import ConfigResult, PlanInputs

SEED_MODEL, SEED_GPU, SEED_GPUS, SEED_TP, SEED_DCP, SEED_WORKLOAD = "Kimi-K2.6", "B200", 8, 8, 8, "agentic"
PUBLISHED_TP_CONCURRENCY = 64
PUBLISHED_TP_KV_USE = 1.00
PUBLISHED_TP_TOK_S_PER_GPU = 1863
PUBLISHED_DCP_CONCURRENCY = 512
PUBLISHED_DCP_KV_USE = 0.82
PUBLISHED_DCP_TOK_S_PER_GPU = 6091
PUBLISHED_RATIO = 3.3


@dataclass(frozen=True)
class SeedRow:
    quantity: str
    predicted: str
    published: str


def seed_inputs(inputs: PlanInputs) -> PlanInputs:
    """The plan as the seed ran it: vLLM's layout (head-split) with its ag_rs merge."""
    setup = (inputs.arch.name, inputs.gpu.name, inputs.num_gpus, inputs.tp, inputs.workload.name)
    if (setup != (SEED_MODEL, SEED_GPU, SEED_GPUS, SEED_TP, SEED_WORKLOAD) or inputs.requested_dcp is not None
            or inputs.dcp_comm_backend == "a2a"):
        raise PlanError("--compare-seed compares with the seed's experiment: use --model kimi-k2.6 --gpu B200 "
                        "--gpus 8 --tp 8 --workload agentic and leave --dcp and --dcp-comm-backend at auto")
    return replace(inputs, dcp_comm_backend="ag_rs")


def compare_with_seed(inputs: PlanInputs, results: list[ConfigResult]) -> list[SeedRow]:
    by_dcp = {r.dcp: r for r in results if r.layout.kind == HEAD_SPLIT}
    tp_only, dcp = by_dcp[1], by_dcp[SEED_DCP]
    # KV tokens per running request that the published points imply under the
    # planner's capacity: a cross-check of the workload, not an input.
    implied_tp = PUBLISHED_TP_KV_USE * tp_only.memory.kv_capacity_tokens / PUBLISHED_TP_CONCURRENCY
    implied_dcp = PUBLISHED_DCP_KV_USE * dcp.memory.kv_capacity_tokens / PUBLISHED_DCP_CONCURRENCY
    rows = [
        SeedRow("TP=8 concurrency ceiling", f"{tp_only.max_concurrency:,}", f"~{PUBLISHED_TP_CONCURRENCY}"),
        SeedRow("TP=8 KV use at the ceiling", f"{tp_only.kv_use:.0%}", f"~{PUBLISHED_TP_KV_USE:.0%}"),
        SeedRow("TP=8 tok/s/GPU", f"{tp_only.tok_s_per_gpu:,.0f}", f"~{PUBLISHED_TP_TOK_S_PER_GPU:,}"),
        SeedRow(f"DCP={SEED_DCP} max concurrency", f"{dcp.max_concurrency:,}", f"{PUBLISHED_DCP_CONCURRENCY}"),
        SeedRow(f"DCP={SEED_DCP} KV use", f"{dcp.kv_use:.0%}", f"{PUBLISHED_DCP_KV_USE:.0%}"),
        SeedRow(f"DCP={SEED_DCP} tok/s/GPU", f"{dcp.tok_s_per_gpu:,.0f}", f"~{PUBLISHED_DCP_TOK_S_PER_GPU:,}"),
        SeedRow(f"DCP={SEED_DCP} / TP=8 tok/s/GPU", f"{dcp.tok_s_per_gpu / tp_only.tok_s_per_gpu:.2f}x",
                f"{PUBLISHED_RATIO}x"),
        SeedRow(f"DCP={SEED_DCP} / TP=8 concurrency", f"{dcp.max_concurrency / tp_only.max_concurrency:.2f}x",
                f"{PUBLISHED_DCP_CONCURRENCY / PUBLISHED_TP_CONCURRENCY:.0f}x"),
    ]
    rows += [SeedRow(f"DCP={r.dcp} / TP=8 tok/s/GPU", f"{r.tok_s_per_gpu / tp_only.tok_s_per_gpu:.2f}x", "-")
             for r in by_dcp.values() if 1 < r.dcp < SEED_DCP]
    rows.append(SeedRow("KV tokens per running request", f"{inputs.tokens_per_request:,} (workload)",
                        f"{implied_tp:,.0f} (TP) / {implied_dcp:,.0f} (DCP) implied"))
    return rows
