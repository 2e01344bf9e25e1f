"""Prefill time of one request from a roofline: FLOPs over an efficiency-derated peak.

A prompt of L tokens is prefilled in chunks of C = `--max-num-batched-tokens` tokens
(vLLM's chunked prefill). A chunk of c new tokens after p cached ones costs, per rank
of a TP group, the sum of four phases that do not overlap (as in a decode step):

- linear layers: max(streamed weights / HBM bandwidth, 2 x (active params / tp +
  replicated projection params) x c / (peak x efficiency)). A chunk of thousands of
  tokens touches every routed expert, so the weights read once per chunk weigh little:
  prefill is compute-bound;
- attention: causal, so the chunk's queries see c x p + c (c + 1) / 2 (query, key)
  pairs; each costs 2 x (key width + value width) FLOPs per head and layer, split
  over the tp ranks (DCP shards the cached keys across a group, the heads are split
  across groups). MLA prefills un-absorbed, as FlashMLA and vLLM do: 192-wide keys
  (nope + rope) and 128-wide values, with the cached latents up-projected by W_UK
  and W_UV once per chunk. Summed over the chunks this is ~L^2 / 2 pairs: prefill
  time grows linearly with L while the linear layers dominate, then quadratically;
- TP: two ring all-reduces of c x hidden bf16 per layer;
- DCP: the chunk's attention to the cached context uses the decode rhythm
  (docs/design.md#prefill), i.e. the decode step's collectives with c query tokens.

Efficiency: dense tensor peaks are not reached by real kernels. The FLOPs of both
linear layers and attention run at `--prefill-efficiency` x the datasheet peak, a
stated assumption (DEFAULT_PREFILL_EFFICIENCY); bandwidths stay at datasheet peak as
in the decode roofline. The LM head runs for the last token only and is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshard.planner.arch import ModelArch
from kvshard.planner.hardware import GpuSpec
from kvshard.planner.layout import AttentionLayout
from kvshard.planner.memory import WeightBytes, linear_bytes_per_param, replicated_projection_params
from kvshard.planner.roofline import ACTIVATION_BYTES, dcp_comm, routed_expert_fraction

# The planner's stated reading of "achievable": large prefill GEMMs and FlashAttention
# kernels run at about half of the dense datasheet peak on Hopper and Blackwell. Not a
# fit to any result; --prefill-efficiency sets it from a measurement.
DEFAULT_PREFILL_EFFICIENCY = 0.5
# vLLM V1's default token budget per step for its OpenAI server on GPUs of 70 GiB or
# more (vllm/engine/arg_utils.py), hence the prefill chunk size.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class PrefillTime:
    """Prefill of one request on one replica (tp GPUs), seconds."""

    input_len: int
    chunk_tokens: int
    chunk_s: tuple[float, ...]  # every chunk, in order: later chunks attend to more context
    linear_s: float
    attention_s: float
    tp_comm_s: float
    dcp_comm_s: float

    @property
    def total_s(self) -> float:
        return sum(self.chunk_s)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_s)

    @property
    def mean_chunk_s(self) -> float:
        return self.total_s / self.num_chunks

    @property
    def longest_chunk_s(self) -> float:
        return max(self.chunk_s)

    @property
    def tokens_per_s(self) -> float:
        """Prompt tokens one replica prefills per second."""
        return self.input_len / self.total_s


def attention_widths(arch: ModelArch) -> tuple[int, int]:
    """(key width, value width) of one head in prefill: un-absorbed for MLA."""
    if arch.is_mla:
        return arch.qk_nope_head_dim + arch.qk_rope_head_dim, arch.v_head_dim
    return arch.head_dim, arch.head_dim


def prefill_time(arch: ModelArch, gpu: GpuSpec, weights: WeightBytes, layout: AttentionLayout, *,
                 kv_slot_bytes: int, input_len: int, chunk_tokens: int, efficiency: float,
                 collective_latency_us: float, backend: str = "auto",
                 a2a_latency_us: float | None = None) -> PrefillTime:
    tp, dcp = layout.tp, layout.dcp
    hbm = gpu.hbm_tbps * 1e12
    linear_peak = (gpu.fp8_tflops if arch.quantization.dtype == "fp8" else gpu.bf16_tflops) * 1e12 * efficiency
    attention_peak = gpu.bf16_tflops * 1e12 * efficiency
    latency = collective_latency_us * 1e-6
    replicated = replicated_projection_params(arch, layout)
    key_width, value_width = attention_widths(arch)
    heads_per_rank = arch.num_heads / tp
    # MLA: FLOPs per cached token, layer and head to up-project its latent into K_nope and V.
    upproject_flops = 2 * arch.kv_lora_rank * (arch.qk_nope_head_dim + arch.v_head_dim) if arch.is_mla else 0
    link = gpu.link_gbps(tp) * 1e9

    chunks, parts = [], [0.0, 0.0, 0.0, 0.0]
    for start in range(0, input_len, chunk_tokens):
        c, p = min(chunk_tokens, input_len - start), start
        streamed = ((weights.every_step + weights.routed_experts * routed_expert_fraction(arch, c)) / tp
                    + replicated * linear_bytes_per_param(arch))
        linear_flops = 2 * (arch.active_params_per_token() / tp + replicated) * c
        linear = max(streamed / hbm, linear_flops / linear_peak)

        pairs = c * p + c * (c + 1) / 2
        attention_flops = arch.num_layers * heads_per_rank * (
            2 * pairs * (key_width + value_width) + p * upproject_flops)
        kv_read = p * kv_slot_bytes / dcp  # the cached context, once per chunk
        attention = max(kv_read / hbm, attention_flops / attention_peak)

        tp_comm = 0.0
        if tp > 1:
            all_reduce = 2 * (tp - 1) / tp * c * arch.hidden_size * ACTIVATION_BYTES
            tp_comm = 2 * arch.num_layers * (all_reduce / link + latency)
        dcp_s = 0.0
        if p > 0:  # the first chunk has no cached context to merge over
            dcp_s = dcp_comm(arch, gpu, layout, backend=backend, batch=c, collective_latency_us=collective_latency_us,
                             a2a_latency_us=collective_latency_us if a2a_latency_us is None else a2a_latency_us)[0]
        for i, t in enumerate((linear, attention, tp_comm, dcp_s)):
            parts[i] += t
        chunks.append(linear + attention + tp_comm + dcp_s)
    return PrefillTime(input_len=input_len, chunk_tokens=chunk_tokens, chunk_s=tuple(chunks), linear_s=parts[0],
                       attention_s=parts[1], tp_comm_s=parts[2], dcp_comm_s=parts[3])
