"""Evaluate every TP/DCP/attention layout asked for: memory, concurrency, throughput curve."""

from __future__ import annotations

from dataclasses import dataclass

from kvshard.planner.arch import ModelArch, dtype_bytes
from kvshard.planner.errors import PlanError
from kvshard.planner.hardware import GpuSpec
from kvshard.planner.layout import AttentionLayout
from kvshard.planner.memory import MemoryPlan, WeightBytes, plan_memory, weight_bytes
from kvshard.planner.prefill import (DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_PREFILL_EFFICIENCY, PrefillTime,
                                     prefill_time)
from kvshard.planner.presets import Workload
from kvshard.planner.roofline import StepTime, decode_step


@dataclass(frozen=True)
class PlanInputs:
    arch: ModelArch
    gpu: GpuSpec
    num_gpus: int
    tp: int
    layouts: tuple[AttentionLayout, ...]  # the valid ones, dcp=1 first
    refused: tuple[tuple[AttentionLayout, str], ...]  # with why they cannot run
    requested_dcp: int | None  # None: --dcp auto
    workload: Workload
    kv_dtype: str
    gpu_memory_utilization: float
    reserve_gib: float
    kv_memory_gib: float | None
    block_size: int
    max_num_seqs: int
    collective_latency_us: float
    dcp_comm_backend: str = "auto"  # auto, ag_rs or a2a
    a2a_latency_us: float | None = None  # None: collective_latency_us
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # the prefill chunk
    prefill_efficiency: float = DEFAULT_PREFILL_EFFICIENCY  # share of peak FLOPs prefill reaches

    @property
    def kv_dtype_bytes(self) -> float:
        return dtype_bytes(self.kv_dtype)

    @property
    def replicas(self) -> int:
        return self.num_gpus // self.tp

    @property
    def tokens_per_request(self) -> int:
        # Room a request needs once its last token is decoded: admitting no more than
        # this many requests means none is ever preempted.
        return self.workload.input_len + self.workload.output_len

    @property
    def mean_context_len(self) -> float:
        # Decode steps of a request attend to input + 1 ... input + output tokens.
        return self.workload.input_len + self.workload.output_len / 2


@dataclass(frozen=True)
class CurvePoint:
    concurrency: int  # requests the clients keep in flight, whole cluster
    running_per_replica: int  # requests that fit in a replica's KV memory and run
    step: StepTime


@dataclass(frozen=True)
class ConfigResult:
    layout: AttentionLayout
    replicas: int
    memory: MemoryPlan
    ceiling_per_replica: int  # concurrent requests the KV memory of one replica holds
    max_num_seqs: int
    operating: StepTime | None  # at the highest concurrency that runs; None if no request fits
    curve: tuple[CurvePoint, ...]
    tokens_per_request: int
    prefill: PrefillTime  # of one request's input, on one replica of this layout

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def dcp(self) -> int:
        return self.layout.dcp

    @property
    def max_concurrency(self) -> int:
        """Cluster-wide concurrency at which throughput stops growing."""
        return min(self.ceiling_per_replica, self.max_num_seqs) * self.replicas

    @property
    def kv_use(self) -> float:
        running = min(self.ceiling_per_replica, self.max_num_seqs)
        return running * self.tokens_per_request / max(self.memory.kv_capacity_tokens, 1)

    @property
    def tok_s_per_gpu(self) -> float:
        return self.operating.tok_s_per_gpu if self.operating else 0.0

    @property
    def limit(self) -> str:
        if self.operating is None:
            return "KV memory (no request fits)"
        if self.ceiling_per_replica < self.max_num_seqs:
            return "KV memory"
        return self.operating.limit


def _concurrency_grid(max_num_seqs: int, ceiling: int) -> list[int]:
    """Per-replica client concurrency: powers of two, the KV ceiling, the scheduler cap."""
    grid = {1 << i for i in range(max_num_seqs.bit_length()) if 1 << i <= max_num_seqs}
    grid |= {max_num_seqs} | ({ceiling} if 0 < ceiling < max_num_seqs else set())
    return sorted(grid)


def _evaluate_layout(inputs: PlanInputs, weights: WeightBytes, memory: MemoryPlan) -> ConfigResult:
    arch, gpu, layout = inputs.arch, inputs.gpu, memory.layout
    ceiling = memory.max_concurrency(inputs.tokens_per_request)

    def step(batch: int) -> StepTime:
        return decode_step(arch, gpu, weights, layout, kv_slot_bytes=memory.kv_slot_bytes, batch=batch,
                           context_len=inputs.mean_context_len, collective_latency_us=inputs.collective_latency_us,
                           backend=inputs.dcp_comm_backend, a2a_latency_us=inputs.a2a_latency_us)

    # Requests beyond what the KV memory holds wait in the queue: throughput plateaus.
    curve = tuple(CurvePoint(concurrency=c * inputs.replicas, running_per_replica=min(c, ceiling),
                             step=step(min(c, ceiling)))
                  for c in _concurrency_grid(inputs.max_num_seqs, ceiling) if ceiling > 0)
    running = min(ceiling, inputs.max_num_seqs)
    return ConfigResult(layout=layout, replicas=inputs.replicas, memory=memory,
                        ceiling_per_replica=ceiling, max_num_seqs=inputs.max_num_seqs,
                        operating=step(running) if running > 0 else None, curve=curve,
                        tokens_per_request=inputs.tokens_per_request,
                        prefill=prefill_for(inputs, weights, layout, memory.kv_slot_bytes))


def prefill_for(inputs: PlanInputs, weights: WeightBytes, layout: AttentionLayout, kv_slot_bytes: int) -> PrefillTime:
    """Prefill of one request of the workload on one replica of `layout`."""
    return prefill_time(inputs.arch, inputs.gpu, weights, layout, kv_slot_bytes=kv_slot_bytes,
                        input_len=inputs.workload.input_len, chunk_tokens=inputs.max_num_batched_tokens,
                        efficiency=inputs.prefill_efficiency, collective_latency_us=inputs.collective_latency_us,
                        backend=inputs.dcp_comm_backend, a2a_latency_us=inputs.a2a_latency_us)


def evaluate(inputs: PlanInputs) -> tuple[list[ConfigResult], list[tuple[AttentionLayout, str]]]:
    """The layouts that fit, evaluated, and those whose weights leave no KV memory,
    with the reason. Raises PlanError when none fits."""
    weights = weight_bytes(inputs.arch)
    results, too_big = [], []
    for layout in inputs.layouts:
        memory = plan_memory(inputs.arch, inputs.gpu, layout, kv_dtype_bytes=inputs.kv_dtype_bytes,
                             gpu_memory_utilization=inputs.gpu_memory_utilization, reserve_gib=inputs.reserve_gib,
                             kv_memory_gib=inputs.kv_memory_gib, block_size=inputs.block_size)
        if isinstance(memory, str):
            too_big.append((layout, memory))
        else:
            results.append(_evaluate_layout(inputs, weights, memory))
    if not results:
        raise PlanError(too_big[0][1])
    return results, too_big
