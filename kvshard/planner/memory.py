"""Memory arithmetic of one TP/DCP layout: weights and KV per GPU, capacity, concurrency.

docs/design.md#kv-accounting: per-rank KV bytes per token = layers * bytes per token per layer / dcp,
where a layer's bytes are those of the KV heads of one attention-TP rank (A = tp / dcp):
max(1, kv_heads / A) heads for GQA, the latent for MLA. A rank stores a token it owns at
full size (its `kv_slot_bytes`); DCP divides how many tokens each rank must own, so the
amortized cost per token of context is slot / dcp.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshard.planner.arch import ModelArch
from kvshard.planner.hardware import GIB, GpuSpec
from kvshard.planner.layout import AttentionLayout

BF16_BYTES = 2


@dataclass(frozen=True)
class WeightBytes:
    """Checkpoint bytes of the whole model, split by how decode reads them."""

    embedding: float  # a lookup of a few rows per step: never streamed
    routed_experts: float  # streamed only for the experts the batch routes to
    every_step: float  # attention, dense MLP, shared experts, routers, LM head

    @property
    def total(self) -> float:
        return self.embedding + self.routed_experts + self.every_step


def weight_bytes(arch: ModelArch) -> WeightBytes:
    p = arch.param_counts()
    quantized = arch.quantization.bytes_per_param()
    linear_bytes = linear_bytes_per_param(arch)
    return WeightBytes(
        embedding=p.embedding * BF16_BYTES,
        routed_experts=p.routed_experts * quantized,
        every_step=(p.attention + p.dense_mlp + p.shared_experts) * linear_bytes
        + (p.router + p.lm_head) * BF16_BYTES,
    )


def linear_bytes_per_param(arch: ModelArch) -> float:
    """Bytes per parameter of the attention, dense MLP and shared-expert weights."""
    quant = arch.quantization
    return quant.bytes_per_param() if quant.scope == "linear" else BF16_BYTES


def replicated_projection_params(arch: ModelArch, layout: AttentionLayout) -> float:
    """Attention projection parameters a rank holds beyond an even 1/tp share: the
    GQA KV heads that tp above the KV heads replicates, and with replicated
    projections N times the group's query-side (and K/V) projections."""
    p = arch.param_counts()
    query_share, kv_share = layout.projection_share(arch)
    return p.attention_query * (query_share - 1 / layout.tp) + p.attention_kv * (kv_share - 1 / layout.tp)


def weight_bytes_per_gpu(arch: ModelArch, weights: WeightBytes, layout: AttentionLayout) -> float:
    # Everything else is sharded over all tp ranks (embedding and LM head by vocabulary).
    return weights.total / layout.tp + replicated_projection_params(arch, layout) * linear_bytes_per_param(arch)


def kv_slot_bytes(arch: ModelArch, layout: AttentionLayout, kv_dtype_bytes: float) -> int:
    """Bytes one cached token takes on the rank that stores it, over all layers: K and
    V of the KV heads of the rank's attention-TP shard (GQA), the full latent (MLA)."""
    return int(arch.num_layers * layout.kv_heads_per_rank(arch) * arch.kv_values_per_token_per_head
               * kv_dtype_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    layout: AttentionLayout
    weight_bytes_per_gpu: float
    kv_memory_bytes_per_gpu: float
    kv_slot_bytes: int
    block_size: int

    @property
    def dcp(self) -> int:
        return self.layout.dcp

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        return self.kv_slot_bytes / self.dcp

    @property
    def kv_blocks_per_gpu(self) -> int:
        # Whole blocks only, as the block pool allocates them.
        return int(self.kv_memory_bytes_per_gpu // (self.block_size * self.kv_slot_bytes))

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens one model replica (tp GPUs) can hold: blocks * B * N (docs/design.md#kv-accounting)."""
        return self.kv_blocks_per_gpu * self.block_size * self.dcp

    def max_concurrency(self, tokens_per_request: int) -> int:
        """Requests one replica holds at once when each may grow to `tokens_per_request`."""
        return self.kv_capacity_tokens // tokens_per_request


def plan_memory(arch: ModelArch, gpu: GpuSpec, layout: AttentionLayout, *, kv_dtype_bytes: float,
                gpu_memory_utilization: float, reserve_gib: float, kv_memory_gib: float | None,
                block_size: int) -> MemoryPlan | str:
    """KV memory per GPU is what is left of HBM * utilization after the weights and a
    fixed reserve (activations, CUDA graphs, collective buffers), unless given. A
    layout whose weights leave no room gets the reason instead of a plan."""
    weights_per_gpu = weight_bytes_per_gpu(arch, weight_bytes(arch), layout)
    where = f"{weights_per_gpu / GIB:.1f} GiB of weights per GPU at {layout.label}"
    if kv_memory_gib is not None:
        kv_memory = kv_memory_gib * GIB
        if weights_per_gpu + kv_memory > gpu.hbm_gib * GIB:
            return (f"--kv-memory-gib {kv_memory_gib:g} plus {where} exceeds the {gpu.hbm_gib:g} GiB of a "
                    f"{gpu.name}: lower it or raise --tp")
    else:
        budget = gpu.hbm_gib * GIB * gpu_memory_utilization - reserve_gib * GIB
        kv_memory = budget - weights_per_gpu
        if kv_memory <= 0:
            return (f"{arch.name} needs {where}, but a {gpu.name} leaves {budget / GIB:.1f} GiB (HBM x "
                    "--gpu-memory-utilization - --reserve-gib): raise --tp and --gpus, quantize with "
                    "--weights-dtype, or pick a larger GPU")
    return MemoryPlan(layout=layout, weight_bytes_per_gpu=weights_per_gpu, kv_memory_bytes_per_gpu=kv_memory,
                      kv_slot_bytes=kv_slot_bytes(arch, layout, kv_dtype_bytes), block_size=block_size)
