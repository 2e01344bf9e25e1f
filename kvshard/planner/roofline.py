"""Decode step time from a roofline: bytes over HBM bandwidth, FLOPs over peak, and
collective volumes over the links plus a fixed latency per collective.

A step is three phases that run one after another: the linear layers (stream the
weights the batch touches), attention (stream the KV cache), and the collectives of
TP and DCP. Each compute phase takes the longer of its memory time and its compute
time; nothing overlaps. Every bandwidth and peak is the datasheet figure, so the
result is a bound that a real engine approaches, not reaches.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshard.planner.arch import ModelArch
from kvshard.planner.hardware import GpuSpec
from kvshard.planner.layout import AttentionLayout
from kvshard.planner.memory import WeightBytes, linear_bytes_per_param, replicated_projection_params

ACTIVATION_BYTES = 2  # hidden states, queries and attention outputs travel in bf16
LSE_BYTES = 4  # the log-sum-exp is kept in float32 (docs/design.md#one-decode-step-of-attention)
DEFAULT_COLLECTIVE_LATENCY_US = 10.0
AG_RS, AG_RS_FUSED, A2A = "ag_rs", "ag_rs fused", "a2a"


@dataclass(frozen=True)
class StepTime:
    """One decode step of one model replica at `batch` running requests (seconds)."""

    batch: int
    tp: int
    linear_s: float
    attention_s: float
    tp_comm_s: float
    dcp_comm_s: float
    dcp_scheme: str  # ag_rs, ag_rs fused, a2a; "-" without DCP
    dcp_collectives_per_layer: int
    linear_compute_bound: bool
    attention_compute_bound: bool

    @property
    def step_s(self) -> float:
        return self.linear_s + self.attention_s + self.tp_comm_s + self.dcp_comm_s

    @property
    def tok_s_per_gpu(self) -> float:
        # Each running request decodes one token per step; a replica spans tp GPUs.
        return self.batch / self.step_s / self.tp

    def time_by_limit(self) -> dict[str, float]:
        """Step time split by what sets it."""
        times = {"HBM bandwidth": 0.0, "compute": 0.0, "communication": self.tp_comm_s + self.dcp_comm_s}
        times["compute" if self.linear_compute_bound else "HBM bandwidth"] += self.linear_s
        times["compute" if self.attention_compute_bound else "HBM bandwidth"] += self.attention_s
        return times

    @property
    def limit(self) -> str:
        times = self.time_by_limit()
        return max(times, key=times.__getitem__)


def routed_expert_fraction(arch: ModelArch, batch: int) -> float:
    """Expected share of a layer's routed experts that at least one of `batch` tokens
    picks, if each token picks experts_per_token of num_experts uniformly."""
    if not arch.is_moe:
        return 0.0
    return 1.0 - (1.0 - arch.experts_per_token / arch.num_experts) ** batch


@dataclass(frozen=True)
class Collective:
    name: str
    bytes_per_token: float  # bytes one rank sends per decoded token and layer


def dcp_merge_schemes(arch: ModelArch, layout: AttentionLayout) -> dict[str, list[Collective]]:
    """The DCP collectives of one layer, per merge scheme (docs/design.md#one-decode-step-of-attention), ring
    or pairwise volumes per rank. H_g = query heads of the group, d_v = width of one
    head of attention output. The head-split layout first gathers the group's queries."""
    n = layout.dcp
    heads = layout.query_heads_per_group(arch)
    out_bytes = arch.attention_value_dim * ACTIVATION_BYTES
    first = []
    if not layout.replicates_projections:
        first = [Collective("Q all-gather",
                            (n - 1) * arch.num_heads / layout.tp * arch.attention_query_dim * ACTIVATION_BYTES)]
    return {
        # LSE all-gather [N, b, H_g], then the scaled outputs reduce-scattered into
        # 1/N feature slices.
        AG_RS: first + [Collective("LSE all-gather", (n - 1) * heads * LSE_BYTES),
                        Collective("reduce-scatter", (n - 1) / n * heads * out_bytes)],
        # One all-gather of [output | lse], merged locally: N times the output bytes
        # of a reduce-scatter, one collective fewer; pays when latency dominates.
        AG_RS_FUSED: first + [Collective("[output|lse] all-gather", (n - 1) * heads * (out_bytes + LSE_BYTES))],
        # Each peer gets its 1/N slice of the partial output and the LSEs of the heads
        # in it, merged locally.
        A2A: first + [Collective("[output|lse] all-to-all", (n - 1) / n * heads * (out_bytes + LSE_BYTES))],
    }


# --dcp-comm-backend -> the merge schemes it may run (ag_rs switches to its fused form
# when that is cheaper, as the engine does for small partial outputs).
BACKEND_SCHEMES = {"auto": (AG_RS, AG_RS_FUSED, A2A), "ag_rs": (AG_RS, AG_RS_FUSED), "a2a": (A2A,)}


def dcp_comm(arch: ModelArch, gpu: GpuSpec, layout: AttentionLayout, *, backend: str, batch: int,
             collective_latency_us: float, a2a_latency_us: float) -> tuple[float, str, int]:
    """(seconds per step, merge scheme, collectives per layer) of the cheapest scheme
    the backend allows at this batch: bytes over the link plus a latency each."""
    if layout.dcp == 1:
        return 0.0, "-", 0
    link = gpu.link_gbps(layout.dcp) * 1e9
    schemes = dcp_merge_schemes(arch, layout)

    def seconds(scheme: str) -> float:
        return arch.num_layers * sum(
            batch * c.bytes_per_token / link
            + (a2a_latency_us if c.name.endswith("all-to-all") else collective_latency_us) * 1e-6
            for c in schemes[scheme])

    # Ties go to the order of BACKEND_SCHEMES: ag_rs first, the rhythm of docs/design.md#one-decode-step-of-attention.
    best = min(BACKEND_SCHEMES[backend], key=seconds)
    return seconds(best), best, len(schemes[best])


def decode_step(arch: ModelArch, gpu: GpuSpec, weights: WeightBytes, layout: AttentionLayout, *,
                kv_slot_bytes: int, batch: int, context_len: float, collective_latency_us: float,
                backend: str = "auto", a2a_latency_us: float | None = None) -> StepTime:
    """`context_len`: mean number of cached tokens each running request attends to.
    `a2a_latency_us`: fixed cost of one all-to-all (default: `collective_latency_us`)."""
    tp, dcp = layout.tp, layout.dcp
    hbm = gpu.hbm_tbps * 1e12
    latency = collective_latency_us * 1e-6

    # Linear layers. W8A8 FP8 checkpoints multiply at the FP8 rate; INT4 is W4A16 and
    # multiplies in bf16 after unpacking. Replicated projections are streamed and
    # multiplied by every rank of a DCP group.
    replicated = replicated_projection_params(arch, layout)
    streamed = ((weights.every_step + weights.routed_experts * routed_expert_fraction(arch, batch)) / tp
                + replicated * linear_bytes_per_param(arch))
    linear_flops = 2 * (arch.active_params_per_token() / tp + replicated) * batch
    linear_peak = (gpu.fp8_tflops if arch.quantization.dtype == "fp8" else gpu.bf16_tflops) * 1e12
    linear_memory_s, linear_compute_s = streamed / hbm, linear_flops / linear_peak

    # Attention. A rank reads only its 1/dcp of each request's tokens, for the query
    # heads of its group (dcp times its 1/tp share), so FLOPs do not change with dcp.
    kv_read = batch * context_len * kv_slot_bytes / dcp
    heads_per_rank = arch.num_heads / tp
    attention_flops = (2 * batch * context_len * heads_per_rank * arch.num_layers
                       * (arch.attention_query_dim + arch.attention_value_dim))
    attention_memory_s, attention_compute_s = kv_read / hbm, attention_flops / (gpu.bf16_tflops * 1e12)

    # TP: ring all-reduce of the hidden state after attention and after the MLP in every
    # layer, then one gather of the vocabulary-sharded logits.
    tp_comm_s = 0.0
    if tp > 1:
        link = gpu.link_gbps(tp) * 1e9
        all_reduce = 2 * (tp - 1) / tp * batch * arch.hidden_size * ACTIVATION_BYTES
        logits = (tp - 1) / tp * batch * arch.vocab_size * ACTIVATION_BYTES
        tp_comm_s = 2 * arch.num_layers * (all_reduce / link + latency) + logits / link + latency

    dcp_comm_s, scheme, collectives = dcp_comm(
        arch, gpu, layout, backend=backend, batch=batch, collective_latency_us=collective_latency_us,
        a2a_latency_us=collective_latency_us if a2a_latency_us is None else a2a_latency_us)
    return StepTime(batch=batch, tp=tp,
                    linear_s=max(linear_memory_s, linear_compute_s),
                    attention_s=max(attention_memory_s, attention_compute_s),
                    tp_comm_s=tp_comm_s, dcp_comm_s=dcp_comm_s, dcp_scheme=scheme,
                    dcp_collectives_per_layer=collectives,
                    linear_compute_bound=linear_compute_s > linear_memory_s,
                    attention_compute_bound=attention_compute_s > attention_memory_s)
