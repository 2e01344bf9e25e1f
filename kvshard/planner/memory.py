"""Memory arithmetic of one TP/DCP layout: weights and KV per GPU, capacity, concurrency.

DESIGN.md section 6: per-rank KV bytes per token = layers * bytes per token per layer / dcp.
A rank stores a token it owns at full size (its `kv_slot_bytes`); DCP divides how many
tokens each rank must own, so the amortized cost per token of context is slot / dcp.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshard.planner.arch import ModelArch
from kvshard.planner.errors import PlanError
from kvshard.planner.hardware import GIB, GpuSpec

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
    quant = arch.quantization
    quantized = quant.bytes_per_param()
    linear_bytes = quantized if quant.scope == "linear" else BF16_BYTES
    return WeightBytes(
        embedding=p.embedding * BF16_BYTES,
        routed_experts=p.routed_experts * quantized,
        every_step=(p.attention + p.dense_mlp + p.shared_experts) * linear_bytes
        + (p.router + p.lm_head) * BF16_BYTES,
    )


def max_dcp(arch: ModelArch, tp: int) -> int:
    """Largest DCP size the layout allows. MLA has one latent "head" that every TP rank
    replicates, so any dcp dividing tp works. GQA: a DCP group must be replicas of one
    KV head (DESIGN.md section 2), and there are tp / kv_heads of them."""
    if arch.is_mla:
        return tp
    return max(tp // arch.num_kv_heads, 1)


def valid_dcps(arch: ModelArch, tp: int) -> list[int]:
    return [d for d in range(1, tp + 1) if tp % d == 0 and d <= max_dcp(arch, tp)]


def validate_layout(arch: ModelArch, num_gpus: int, tp: int, dcp: int | None) -> None:
    """Raise PlanError, saying what to change, for a layout that cannot run."""
    if num_gpus < 1 or tp < 1:
        raise PlanError("--gpus and --tp must be at least 1")
    if num_gpus % tp:
        raise PlanError(f"--tp {tp} does not divide --gpus {num_gpus}: use a tp that divides the GPU count "
                        "(each tp-sized group serves one model replica)")
    if arch.num_heads % tp:
        raise PlanError(f"--tp {tp} does not divide the {arch.num_heads} attention heads of {arch.name}: "
                        "use a tp that divides them")
    kv = arch.num_kv_heads
    if not arch.is_mla and kv % tp and tp % kv:
        raise PlanError(f"--tp {tp} neither divides nor is a multiple of the {kv} KV heads of {arch.name}: "
                        f"use a tp that divides {kv} or a multiple of it")
    if dcp is None:
        return
    if dcp < 1 or tp % dcp:
        raise PlanError(f"--dcp {dcp} does not divide --tp {tp}: DCP reuses the TP ranks, "
                        f"use one of {', '.join(str(d) for d in range(1, tp + 1) if tp % d == 0)}")
    if dcp > max_dcp(arch, tp):
        replicas = tp // kv if tp >= kv else 0
        raise PlanError(f"--dcp {dcp} is larger than tp/kv_heads = {tp}/{kv} for GQA model {arch.name}: "
                        f"a DCP group must hold replicas of one KV head and tp={tp} makes "
                        f"{replicas if replicas > 1 else 'no'} replicas; use --dcp {max_dcp(arch, tp)} "
                        f"or raise --tp to {kv * dcp}")


def kv_slot_bytes(arch: ModelArch, tp: int, kv_dtype_bytes: float) -> int:
    """Bytes one cached token takes on the rank that stores it, over all layers.
    GQA: K and V of this rank's KV heads; a rank holds at least one whole head, so
    tp > kv_heads replicates heads. MLA: the full latent, whatever tp is."""
    heads_on_rank = 1 if arch.is_mla else max(arch.num_kv_heads // tp, 1)
    return int(arch.num_layers * heads_on_rank * arch.kv_values_per_token_per_head * kv_dtype_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    tp: int
    dcp: int
    weight_bytes_per_gpu: float
    kv_memory_bytes_per_gpu: float
    kv_slot_bytes: int
    block_size: int

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        return self.kv_slot_bytes / self.dcp

    @property
    def kv_blocks_per_gpu(self) -> int:
        # Whole blocks only, as the block pool allocates them.
        return int(self.kv_memory_bytes_per_gpu // (self.block_size * self.kv_slot_bytes))

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens one model replica (tp GPUs) can hold: DESIGN.md's blocks * B * N."""
        return self.kv_blocks_per_gpu * self.block_size * self.dcp

    def max_concurrency(self, tokens_per_request: int) -> int:
        """Requests one replica holds at once when each may grow to `tokens_per_request`."""
        return self.kv_capacity_tokens // tokens_per_request


def plan_memory(arch: ModelArch, gpu: GpuSpec, tp: int, dcp: int, *, kv_dtype_bytes: float,
                gpu_memory_utilization: float, reserve_gib: float, kv_memory_gib: float | None,
                block_size: int) -> MemoryPlan:
    """KV memory per GPU is what is left of HBM * utilization after the weights and a
    fixed reserve (activations, CUDA graphs, collective buffers), unless given."""
    weights = weight_bytes(arch)
    # Every weight is sharded over the TP group (embedding and LM head by vocabulary).
    weights_per_gpu = weights.total / tp
    if kv_memory_gib is not None:
        kv_memory = kv_memory_gib * GIB
        if weights_per_gpu + kv_memory > gpu.hbm_gib * GIB:
            raise PlanError(f"--kv-memory-gib {kv_memory_gib:g} plus {weights_per_gpu / GIB:.1f} GiB of weights per "
                            f"GPU at tp={tp} exceeds the {gpu.hbm_gib:g} GiB of a {gpu.name}: lower it or raise --tp")
    else:
        budget = gpu.hbm_gib * GIB * gpu_memory_utilization - reserve_gib * GIB
        kv_memory = budget - weights_per_gpu
        if kv_memory <= 0:
            raise PlanError(
                f"{arch.name} needs {weights_per_gpu / GIB:.1f} GiB of weights per GPU at tp={tp}, but a "
                f"{gpu.name} leaves {budget / GIB:.1f} GiB (HBM x --gpu-memory-utilization - --reserve-gib): "
                "raise --tp and --gpus, quantize with --weights-dtype, or pick a larger GPU")
    return MemoryPlan(tp=tp, dcp=dcp, weight_bytes_per_gpu=weights_per_gpu, kv_memory_bytes_per_gpu=kv_memory,
                      kv_slot_bytes=kv_slot_bytes(arch, tp, kv_dtype_bytes), block_size=block_size)
