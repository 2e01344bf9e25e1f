"""Turn the evaluated layouts into advice, in the words of the seed article's guide.

Guide: use DCP for long contexts (32K+), MLA models, tp above the KV heads, KV use
above 90%; avoid it for short contexts (8K or less) and without NVLink; keep dcp at
2-4 unless the gain is large. The thresholds below are the guide's; LARGE_GAIN and
MIN_GAIN are this planner's stated reading of "large" and "worth it".
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshard.planner.memory import max_dcp
from kvshard.planner.plan import ConfigResult, PlanInputs

SHORT_CONTEXT_TOKENS = 8 * 1024
LONG_CONTEXT_TOKENS = 32 * 1024
KV_BOTTLENECK_USE = 0.90
GUIDE_MAX_DCP = 4
LARGE_GAIN = 1.25  # dcp above 4 must beat the best dcp <= 4 by 25%
MIN_GAIN = 1.05  # below +5% the extra collectives are not worth running


@dataclass(frozen=True)
class Recommendation:
    dcp: int  # 1: no DCP
    interleave_size: int
    reasons: tuple[str, ...]
    warnings: tuple[str, ...]


def _gain(result: ConfigResult, base: ConfigResult) -> float:
    # Infinite when not one request fits without DCP: any DCP that fits one wins.
    return result.tok_s_per_gpu / base.tok_s_per_gpu if base.tok_s_per_gpu else float("inf")


def _predicted(result: ConfigResult, base: ConfigResult) -> str:
    gain = f"x{_gain(result, base):.2f}" if base.tok_s_per_gpu else "where dcp=1 fits no request"
    return (f"predicted {base.tok_s_per_gpu:,.0f} -> {result.tok_s_per_gpu:,.0f} tok/s/GPU for dcp={result.dcp} "
            f"({gain}), concurrency {base.max_concurrency} -> {result.max_concurrency}")


def layout_warnings(inputs: PlanInputs, dcp: int) -> list[str]:
    """What the guide warns about for running this dcp."""
    gpu, context = inputs.gpu, inputs.workload.input_len
    warnings = []
    if dcp > 1 and context <= SHORT_CONTEXT_TOKENS:
        warnings.append(f"short contexts ({context:,} <= 8K tokens): the DCP AllGather overhead can outweigh the gain")
    if dcp > 1 and not gpu.has_nvlink:
        warnings.append(f"no NVLink: DCP collectives run over PCIe at {gpu.pcie_gbps:g} GB/s")
    if dcp > GUIDE_MAX_DCP:
        warnings.append(f"dcp={dcp} is above the guide's 2-4: AllGather cost grows with the group, measure it")
    if dcp > gpu.gpus_per_node:
        warnings.append(f"dcp={dcp} spans more than one node ({gpu.gpus_per_node} GPUs): its collectives "
                        f"leave NVLink for the {gpu.network_gbps:g} GB/s network")
    return warnings


def _interleave_reason(inputs: PlanInputs, dcp: int) -> str:
    block = inputs.block_size
    shard = inputs.workload.input_len / dcp
    return (f"interleave size 1 (token i on rank i mod {dcp}): the best balance; interleave {block} keeps whole "
            f"blocks on a rank, for moving blocks between instances, at up to {block} tokens of imbalance "
            f"({block / shard:.2%} of a rank's shard)")


def _why_copies(inputs: PlanInputs, dcp: int) -> str:
    arch, tp = inputs.arch, inputs.tp
    if arch.is_mla:
        return (f"MLA model: at tp={tp} every rank stores the same latent KV ({tp} copies); "
                f"dcp={dcp} leaves {tp // dcp} and gives {dcp}x the KV capacity")
    replicas = tp // arch.num_kv_heads
    return (f"tp={tp} is above the {arch.num_kv_heads} KV heads: each head is stored on {replicas} ranks; "
            f"dcp={dcp} shards it instead of copying it")


def recommend(inputs: PlanInputs, results: list[ConfigResult]) -> Recommendation:
    arch, tp, context = inputs.arch, inputs.tp, inputs.workload.input_len
    base = next(r for r in results if r.dcp == 1)
    candidates = [r for r in results if r.dcp > 1 and r.operating is not None]
    warnings: list[str] = []
    if tp > inputs.gpu.gpus_per_node:
        warnings.append(f"tp={tp} spans more than one node: every TP all-reduce goes over the network")
    if inputs.requested_dcp and inputs.requested_dcp > 1:
        warnings += layout_warnings(inputs, inputs.requested_dcp)

    def no_dcp(*reasons: str) -> Recommendation:
        return Recommendation(dcp=1, interleave_size=1, reasons=reasons, warnings=tuple(warnings))

    if not arch.is_mla and tp <= arch.num_kv_heads:
        return no_dcp(f"DCP is impossible: {arch.name} has {arch.num_kv_heads} KV heads and tp={tp} gives every "
                      "rank different heads, so there is no KV copy to remove; DCP needs tp above the KV heads "
                      f"(tp={2 * arch.num_kv_heads} would allow dcp=2)")
    if all(r.dcp == 1 for r in results):
        return no_dcp("DCP reuses the TP ranks: tp=1 has none to shard over" if tp == 1 else "--dcp 1 was asked for")
    if not candidates:
        return no_dcp(f"not one request of {inputs.tokens_per_request:,} tokens fits, with or without DCP: "
                      "raise --tp and --gpus or shorten the requests")
    best = max(candidates, key=lambda r: r.tok_s_per_gpu)
    predicted = _predicted(best, base)
    if not inputs.gpu.has_nvlink:
        return no_dcp(f"no NVLink: the guide avoids DCP when its AllGather runs over PCIe (the roofline "
                      f"{predicted})")
    if context <= SHORT_CONTEXT_TOKENS:
        return no_dcp(f"short contexts ({context:,} <= 8K tokens): the guide avoids DCP there, the AllGather "
                      f"overhead can outweigh the gain (the roofline {predicted}, but leaves out per-step "
                      "overheads that weigh most on short contexts)")
    if _gain(best, base) < MIN_GAIN:
        return no_dcp(f"DCP does not pay: {predicted}, below the +{MIN_GAIN - 1:.0%} worth its collectives")

    reasons = []
    chosen = best
    small = [r for r in candidates if r.dcp <= GUIDE_MAX_DCP]
    if best.dcp > GUIDE_MAX_DCP and small:
        best_small = max(small, key=lambda r: r.tok_s_per_gpu)
        step_up = _gain(best, best_small)
        if step_up < LARGE_GAIN:
            chosen = best_small
            reasons.append(f"dcp={best.dcp} would add only +{step_up - 1:.0%} over dcp={best_small.dcp}: "
                           "the guide keeps dcp at 2-4 unless the gain is large")
        else:
            reasons.append(f"dcp={best.dcp} gives +{step_up - 1:.0%} over dcp={best_small.dcp}: a large enough "
                           f"gain (>= +{LARGE_GAIN - 1:.0%}) to go past the guide's 2-4")
    reasons.insert(0, _why_copies(inputs, chosen.dcp))
    if context >= LONG_CONTEXT_TOKENS:
        reasons.append(f"long contexts ({context:,} >= 32K tokens): the guide's main case for DCP")
    else:
        reasons.append(f"medium contexts ({context:,} tokens, between 8K and 32K): chosen on the predicted gain alone")
    if base.operating is None:
        reasons.append(f"KV memory is the bottleneck without DCP: not one request of "
                       f"{inputs.tokens_per_request:,} tokens fits")
    elif base.kv_use >= KV_BOTTLENECK_USE and base.ceiling_per_replica < inputs.max_num_seqs:
        reasons.append(f"KV memory is the bottleneck without DCP: {base.max_concurrency} concurrent requests "
                       f"fill it (KV use {base.kv_use:.0%})")
    reasons.append(_predicted(chosen, base))
    if max_dcp(arch, tp) < tp:
        reasons.append(f"GQA caps dcp at tp/kv_heads = {tp}/{arch.num_kv_heads}")
    reasons.append(_interleave_reason(inputs, chosen.dcp))
    if not inputs.requested_dcp:
        warnings += layout_warnings(inputs, chosen.dcp)
    return Recommendation(dcp=chosen.dcp, interleave_size=1, reasons=tuple(reasons), warnings=tuple(warnings))
