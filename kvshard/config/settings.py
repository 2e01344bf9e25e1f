"""The parallel, cache and scheduler settings, as the engine and every rank see them (frozen, validated
by EngineArgs before they are built)."""

from __future__ import annotations

from dataclasses import dataclass

from kvshard.config.layout_rules import ATTENTION_LAYOUTS, HEAD_SPLIT, REPLICATED, attention_tp_size

__all__ = ["ATTENTION_LAYOUTS", "CacheConfig", "DCP_COMM_BACKENDS", "FCFS", "HEAD_SPLIT", "LPM", "ParallelConfig",
           "REPLICATED", "SCHEDULING_POLICIES", "SchedulerConfig"]

DCP_COMM_BACKENDS = ("auto", "ag_rs", "a2a")  # vLLM's --dcp-comm-backend names


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    decode_context_parallel_size: int
    dcp_kv_interleave_size: int
    attention_layout: str = HEAD_SPLIT  # resolved: HEAD_SPLIT or REPLICATED
    dcp_comm_backend: str = "auto"  # one of DCP_COMM_BACKENDS: how a DCP group merges its partial attentions
    # a MoE layer's routed experts: False, each expert split over the ranks by its intermediate dimension
    # (vLLM's default); True, whole experts on each rank (vLLM's --enable-expert-parallel)
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        # DCP reuses the TP ranks: it never adds processes.
        return self.tensor_parallel_size

    @property
    def attention_tp_size(self) -> int:
        """A = T / N: attention heads split this many ways, one share per DCP group."""
        return attention_tp_size(self.tensor_parallel_size, self.decode_context_parallel_size)

    @property
    def num_dcp_groups(self) -> int:
        """One DCP group per share of the heads: A of them (layout_rules.attention_tp_size)."""
        return self.attention_tp_size

    def dcp_groups(self) -> list[list[int]]:
        """Contiguous slices of the TP ranks: tp=4, dcp=2 -> [[0, 1], [2, 3]]."""
        n = self.decode_context_parallel_size
        return [list(range(g * n, (g + 1) * n)) for g in range(self.num_dcp_groups)]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kv_cache_memory: int  # bytes per rank
    num_kv_blocks: int | None  # overrides kv_cache_memory when set
    enable_prefix_caching: bool
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" (or "fp8_e4m3"): float8 e4m3


FCFS = "fcfs"  # waiting requests are admitted in arrival order
LPM = "lpm"  # longest cached prefix first (SGLang's name): a session's next turn while its prefix is cached
SCHEDULING_POLICIES = (FCFS, LPM)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = FCFS  # one of SCHEDULING_POLICIES

