"""Turn the evaluated layouts into advice, in the words of the seed article's guide.

Guide: use DCP for long contexts (32K+), MLA models, tp above the KV heads, KV use
above 90%; avoid it for short contexts (8K or less) and without NVLink; keep dcp at
2-4 unless the gain is large. The thresholds below are the guide's; LARGE_GAIN and
MIN_GAIN are this planner's stated reading of "large" and "worth it". Among layouts
of one dcp the faster wins (head-split on a tie: it needs no extra weights); the
communication backend is the one the roofline finds cheaper at the operating batch,
unless one was asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshard.planner.hardware import GIB
from kvshard.planner.layout import HEAD_SPLIT, REPLICATED
from kvshard.planner.plan import ConfigResult, PlanInputs
from kvshard.planner.roofline import A2A, dcp_comm

SHORT_CONTEXT_TOKENS = 8 * 1024
LONG_CONTEXT_TOKENS = 32 * 1024
KV_BOTTLENECK_USE = 0.90
GUIDE_MAX_DCP = 4
LARGE_GAIN = 1.25  # dcp above 4 must beat the best dcp <= 4 by 25%
MIN_GAIN = 1.05  # below +5% the extra collectives are not worth running


@dataclass(frozen=True)
class Recommendation:
    dcp: int  # 1: no DCP
    attention_tp: int  # A = tp / dcp
    attention_layout: str  # HEAD_SPLIT or REPLICATED
    comm_backend: str  # the --dcp-comm-backend to run: ag_rs or a2a; "-" without DCP
    interleave_size: int
    reasons: tuple[str, ...]
    warnings: tuple[str, ...]

    def chose(self, result: ConfigResult) -> bool:
        return result.dcp == self.dcp and (self.dcp == 1 or result.layout.kind == self.attention_layout)


def _gain(result: ConfigResult, base: ConfigResult | None) -> float:
    # Infinite when not one request fits without DCP (or dcp=1 cannot run at all).
    return result.tok_s_per_gpu / base.tok_s_per_gpu if base and base.tok_s_per_gpu else float("inf")


def _predicted(result: ConfigResult, base: ConfigResult | None) -> str:
    if base is None:
        return (f"predicted {result.tok_s_per_gpu:,.0f} tok/s/GPU for {result.layout.label}, "
                f"concurrency {result.max_concurrency}")
    gain = f"x{_gain(result, base):.2f}" if base.tok_s_per_gpu else "where dcp=1 fits no request"
    return (f"predicted {base.tok_s_per_gpu:,.0f} -> {result.tok_s_per_gpu:,.0f} tok/s/GPU for dcp={result.dcp} "
            f"({gain}), concurrency {base.max_concurrency} -> {result.max_concurrency}")


def _rank(result: ConfigResult) -> tuple[float, bool, int]:
    """Best first: throughput, then head-split (no extra weights), then the smaller dcp."""
    return (result.tok_s_per_gpu, result.layout.kind == HEAD_SPLIT, -result.dcp)


def layout_warnings(inputs: PlanInputs, dcp: int) -> list[str]:
    """What the guide warns about for running this dcp."""
    gpu, context = inputs.gpu, inputs.workload.input_len
    warnings = []
    if dcp > 1 and context <= SHORT_CONTEXT_TOKENS:
        warnings.append(f"short contexts ({context:,} <= 8K tokens): the DCP collectives can outweigh the gain")
    if dcp > 1 and not gpu.has_nvlink:
        warnings.append(f"no NVLink: DCP collectives run over PCIe at {gpu.pcie_gbps:g} GB/s")
    if dcp > GUIDE_MAX_DCP:
        warnings.append(f"dcp={dcp} is above the guide's 2-4: the cost of its collectives grows with the group, "
                        "measure it")
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


def _why_copies(inputs: PlanInputs, chosen: ConfigResult) -> str:
    arch, tp, dcp = inputs.arch, inputs.tp, chosen.dcp
    if arch.is_mla:
        return (f"MLA model: at tp={tp} every rank stores the same latent KV ({tp} copies); "
                f"dcp={dcp} leaves {tp // dcp} and gives {dcp}x the KV capacity")
    kv, per_rank = arch.num_kv_heads, chosen.layout.kv_heads_per_rank(arch)
    return (f"tp={tp} is above the {kv} KV heads: each head is stored on {tp // kv} ranks; dcp={dcp} "
            f"(A={chosen.layout.attention_tp}) holds {per_rank} KV head(s) per group on 1/{dcp} of the tokens "
            "each, with no copy left")


def _layout_reason(inputs: PlanInputs, chosen: ConfigResult, results: list[ConfigResult]) -> str:
    arch, layout = inputs.arch, chosen.layout
    other_kind = REPLICATED if layout.kind == HEAD_SPLIT else HEAD_SPLIT
    other = next((r for r in results if r.dcp == chosen.dcp and r.layout.kind == other_kind), None)
    refused = next((why for lay, why in inputs.refused if lay.dcp == chosen.dcp and lay.kind == other_kind), None)
    if other is not None and other.tok_s_per_gpu:
        versus = f"{chosen.tok_s_per_gpu / other.tok_s_per_gpu - 1:+.1%} tok/s/GPU against {other_kind}"
    else:
        versus = f"{other_kind} cannot run" + (f" ({refused})" if refused else " (no request fits)")
    comm = f"{chosen.operating.dcp_collectives_per_layer} DCP collective(s) per layer"
    if layout.kind == HEAD_SPLIT:
        return (f"head-split attention: the {arch.num_heads} query heads split over all {inputs.tp} ranks and "
                f"gathered in each group, {comm}, no extra weights; {versus}")
    weights = (f"+{(chosen.memory.weight_bytes_per_gpu - other.memory.weight_bytes_per_gpu) / GIB:.2f} GiB of "
               "weights per GPU against head-split" if other else f"{layout.dcp}x the query-side projections")
    return (f"replicated projections: every rank of a group computes its group's "
            f"{layout.query_heads_per_group(arch):g} query heads ({weights}), {comm}; {versus}")


def _backend_reason(inputs: PlanInputs, chosen: ConfigResult) -> str:
    step = chosen.operating
    batch = step.batch
    times = {backend: dcp_comm(inputs.arch, inputs.gpu, chosen.layout, backend=backend, batch=batch,
                               collective_latency_us=inputs.collective_latency_us,
                               a2a_latency_us=(inputs.collective_latency_us if inputs.a2a_latency_us is None
                                               else inputs.a2a_latency_us))
             for backend in ("ag_rs", "a2a")}
    compared = ", ".join(f"{b} {t * 1e3:.2f} ms ({scheme}, {n}/layer)" for b, (t, scheme, n) in times.items())
    cheaper = min(times, key=lambda b: times[b][0])
    chosen_flag = _backend_flag(step.dcp_scheme)
    if inputs.dcp_comm_backend == "auto":
        how = "the cheaper"
    elif chosen_flag == cheaper:
        how = "set, and the cheaper"
    else:
        how = f"set; {cheaper} would save {(times[chosen_flag][0] - times[cheaper][0]) * 1e3:.2f} ms per step"
    return (f"--dcp-comm-backend {chosen_flag} ({how}): DCP collectives per step at {batch} running requests: "
            f"{compared}")


def _backend_flag(scheme: str) -> str:
    return "a2a" if scheme == A2A else "ag_rs"


def recommend(inputs: PlanInputs, results: list[ConfigResult]) -> Recommendation:
    arch, tp, context = inputs.arch, inputs.tp, inputs.workload.input_len
    base = next((r for r in results if r.dcp == 1), None)
    candidates = [r for r in results if r.dcp > 1 and r.operating is not None]
    warnings: list[str] = []
    if tp > inputs.gpu.gpus_per_node:
        warnings.append(f"tp={tp} spans more than one node: every TP all-reduce goes over the network")
    if inputs.requested_dcp and inputs.requested_dcp > 1:
        warnings += layout_warnings(inputs, inputs.requested_dcp)

    def no_dcp(*reasons: str) -> Recommendation:
        return Recommendation(dcp=1, attention_tp=tp, attention_layout=HEAD_SPLIT, comm_backend="-",
                              interleave_size=1, reasons=reasons, warnings=tuple(warnings))

    if all(r.dcp == 1 for r in results):
        if tp == 1:
            return no_dcp("DCP reuses the TP ranks: tp=1 has none to shard over")
        if inputs.requested_dcp == 1:
            return no_dcp("--dcp 1 was asked for")
        return no_dcp("no DCP layout can run: " + "; ".join(f"{layout.label}: {why}" for layout, why in inputs.refused))
    if not candidates:
        return no_dcp(f"not one request of {inputs.tokens_per_request:,} tokens fits, with or without DCP: "
                      "raise --tp and --gpus or shorten the requests")
    best = max(candidates, key=_rank)
    predicted = _predicted(best, base)
    if base is not None:
        least_kv = min(r.memory.kv_bytes_per_token_per_gpu for r in candidates)
        if least_kv >= base.memory.kv_bytes_per_token_per_gpu:
            return no_dcp(f"DCP removes no KV copy: {arch.name} has {arch.num_kv_heads} KV heads and tp={tp} "
                          "already gives every rank different heads; a DCP group of N holds N times the heads "
                          f"on 1/N of the tokens, the same {least_kv:,.0f} bytes per token and GPU at best, plus "
                          f"its collectives (tp={2 * arch.num_kv_heads} would leave copies to remove)")
        if not inputs.gpu.has_nvlink:
            return no_dcp(f"no NVLink: the guide avoids DCP when its collectives run over PCIe (the roofline "
                          f"{predicted})")
        if context <= SHORT_CONTEXT_TOKENS:
            return no_dcp(f"short contexts ({context:,} <= 8K tokens): the guide avoids DCP there, its "
                          f"collectives can outweigh the gain (the roofline {predicted}, but leaves out per-step "
                          "overheads that weigh most on short contexts)")
        if _gain(best, base) < MIN_GAIN:
            return no_dcp(f"DCP does not pay: {predicted}, below the +{MIN_GAIN - 1:.0%} worth its collectives")

    reasons = []
    chosen = best
    small = [r for r in candidates if r.dcp <= GUIDE_MAX_DCP]
    if best.dcp > GUIDE_MAX_DCP and small:
        best_small = max(small, key=_rank)
        step_up = _gain(best, best_small)
        if step_up < LARGE_GAIN:
            chosen = best_small
            reasons.append(f"dcp={best.dcp} would add only {step_up - 1:+.0%} over dcp={best_small.dcp}: "
                           "the guide keeps dcp at 2-4 unless the gain is large")
        else:
            reasons.append(f"dcp={best.dcp} gives +{step_up - 1:.0%} over dcp={best_small.dcp}: a large enough "
                           f"gain (>= +{LARGE_GAIN - 1:.0%}) to go past the guide's 2-4")
    if base is None:
        why = next(why for layout, why in inputs.refused if layout.dcp == 1)
        reasons.insert(0, f"dcp=1 cannot run: {why}; only DCP layouts can")
    else:
        reasons.insert(0, _why_copies(inputs, chosen))
    reasons.append(_layout_reason(inputs, chosen, results))
    reasons.append(_backend_reason(inputs, chosen))
    if context >= LONG_CONTEXT_TOKENS:
        reasons.append(f"long contexts ({context:,} >= 32K tokens): the guide's main case for DCP")
    elif context > SHORT_CONTEXT_TOKENS:
        reasons.append(f"medium contexts ({context:,} tokens, between 8K and 32K): chosen on the predicted gain alone")
    if base is not None and base.operating is None:
        reasons.append(f"KV memory is the bottleneck without DCP: not one request of "
                       f"{inputs.tokens_per_request:,} tokens fits")
    elif base is not None and base.kv_use >= KV_BOTTLENECK_USE and base.ceiling_per_replica < inputs.max_num_seqs:
        reasons.append(f"KV memory is the bottleneck without DCP: {base.max_concurrency} concurrent requests "
                       f"fill it (KV use {base.kv_use:.0%})")
    reasons.append(_predicted(chosen, base))
    reasons.append(_interleave_reason(inputs, chosen.dcp))
    if not inputs.requested_dcp:
        warnings += layout_warnings(inputs, chosen.dcp)
    return Recommendation(dcp=chosen.dcp, attention_tp=chosen.layout.attention_tp,
                          attention_layout=chosen.layout.kind, comm_backend=_backend_flag(chosen.operating.dcp_scheme),
                          interleave_size=1, reasons=tuple(reasons), warnings=tuple(warnings))
