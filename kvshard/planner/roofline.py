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
from kvshard.planner.memory import WeightBytes

ACTIVATION_BYTES = 2  # hidden states, queries and attention outputs travel in bf16
LSE_BYTES = 4  # the log-sum-exp is kept in float32 (DESIGN.md section 4)
DEFAULT_COLLECTIVE_LATENCY_US = 10.0


@dataclass(frozen=True)
class StepTime:
    """One decode step of one model replica at `batch` running requests (seconds)."""

    batch: int
    tp: int
    linear_s: float
    attention_s: float
    tp_comm_s: float
    dcp_comm_s: float
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


def decode_step(arch: ModelArch, gpu: GpuSpec, weights: WeightBytes, *, tp: int, dcp: int, kv_slot_bytes: int,
                batch: int, context_len: float, collective_latency_us: float) -> StepTime:
    """`context_len`: mean number of cached tokens each running request attends to."""
    hbm = gpu.hbm_tbps * 1e12
    latency = collective_latency_us * 1e-6

    # Linear layers. W8A8 FP8 checkpoints multiply at the FP8 rate; INT4 is W4A16 and
    # multiplies in bf16 after unpacking.
    streamed = (weights.every_step + weights.routed_experts * routed_expert_fraction(arch, batch)) / tp
    linear_flops = 2 * arch.active_params_per_token() * batch / tp
    linear_peak = (gpu.fp8_tflops if arch.quantization.dtype == "fp8" else gpu.bf16_tflops) * 1e12
    linear_memory_s, linear_compute_s = streamed / hbm, linear_flops / linear_peak

    # Attention. A rank reads only its 1/dcp of each request's tokens; with DCP it
    # serves dcp * heads_per_rank query heads over them, so FLOPs do not change.
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

    # DCP, per layer and rank (DESIGN.md section 4): AllGather Q, AllGather LSE,
    # ReduceScatter of the outputs: three collectives.
    dcp_comm_s = 0.0
    if dcp > 1:
        link = gpu.link_gbps(dcp) * 1e9
        per_token = (dcp - 1) * heads_per_rank * (
            arch.attention_query_dim * ACTIVATION_BYTES + dcp * LSE_BYTES + arch.attention_value_dim * ACTIVATION_BYTES)
        dcp_comm_s = arch.num_layers * (batch * per_token / link + 3 * latency)

    return StepTime(batch=batch, tp=tp,
                    linear_s=max(linear_memory_s, linear_compute_s),
                    attention_s=max(attention_memory_s, attention_compute_s),
                    tp_comm_s=tp_comm_s, dcp_comm_s=dcp_comm_s,
                    linear_compute_bound=linear_compute_s > linear_memory_s,
                    attention_compute_bound=attention_compute_s > attention_memory_s)
