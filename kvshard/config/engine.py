"""`EngineConfig`: the whole configuration of one engine, and what it derives: the KV bytes, blocks and
capacity of a rank (byte accounting) and the attention shares of the chosen layout."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch

from kvshard.config import layout_rules as rules
from kvshard.config.generation import GenerationDefaults
from kvshard.config.model import ModelConfig
from kvshard.config.settings import CacheConfig, ParallelConfig, SchedulerConfig
from kvshard.kv.cache import KVCacheSpec, kv_cache_spec, resolve_kv_cache_dtype
from kvshard.kv.layout import DCPLayout
from kvshard.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    parallel: ParallelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    seed: int
    batch_invariant: bool = False  # EngineArgs.batch_invariant
    speculative: SpeculativeConfig | None = None
    attention_backend: str = "auto"  # EngineArgs.attention_backend, resolved (attention/backends.py)
    enforce_eager: bool = False  # EngineArgs.enforce_eager: no CUDA graphs (engine/cuda_graphs.py), no compile
    compilation_level: int = 0  # EngineArgs.compilation_config, parsed: 0 eager, 3 compiled (kvshard/compilation.py)
    # the sampling defaults of requests that leave them out (EngineArgs.generation_config; config/generation.py)
    generation: GenerationDefaults = dataclasses.field(default_factory=GenerationDefaults)
    max_model_len_source: str = ""  # where scheduler.max_model_len came from, for the start-up report
    notes: tuple[str, ...] = ()  # settings given that change nothing kvshard does, said at start-up

    @cached_property
    def dcp_layout(self) -> DCPLayout:
        """Where each token's K/V lives in its DCP group: one object for the scheduler and every runner."""
        p = self.parallel
        return DCPLayout(self.cache.block_size, p.decode_context_parallel_size, p.dcp_kv_interleave_size)

    # --- KV accounting (docs/design.md#kv-accounting), all per rank -------------------
    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """The cache one rank holds, derived once from the model: the runner allocates this spec."""
        return kv_cache_spec(self.model, self.parallel.attention_tp_size)

    @property
    def kv_heads_per_rank(self) -> int:
        return self.kv_cache_spec.num_kv_heads

    @property
    def kv_copies_per_token(self) -> int:
        """How many ranks store the same K/V of a token: the DCP groups holding one KV head
        (A / kv_heads when attention-TP exceeds the KV heads); a group stores it once."""
        p = self.parallel
        return rules.kv_copies_per_token(self.model.attention_shape, p.tensor_parallel_size,
                                         p.decode_context_parallel_size)

    # --- attention layout -------------------------------------------------------------
    @property
    def query_heads_per_rank(self) -> int:
        """Heads whose query one rank computes: its 1/T share (head-split) or its group's 1/A."""
        p = self.parallel
        return int(rules.query_heads_per_rank(self.model.attention_shape, p.tensor_parallel_size,
                                              p.decode_context_parallel_size, p.attention_layout))

    @property
    def replicated_projection_bytes_per_rank(self) -> int:
        """Projection bytes one rank holds beyond plain TP's share of the heads (all layers; 0 for
        head-split): the group's queries, and its K/V heads when they outnumber plain TP's. The price
        of skipping the Q all-gather, counted at the model dtype."""
        model, tp = self.model, self.parallel.tensor_parallel_size
        plain_tp = model.head_projection_params(model.num_heads // tp, max(1, model.num_kv_heads // tp))
        extra = model.head_projection_params(self.query_heads_per_rank, self.kv_heads_per_rank) - plain_tp
        return model.num_layers * extra * model.dtype.itemsize

    @property
    def kv_bytes_per_token_per_rank(self) -> float:
        """Average bytes one token costs on one rank: a group stores each token once."""
        return self.kv_bytes_per_slot / self.parallel.decode_context_parallel_size

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype the cache stores; attention reads it back in the model's dtype."""
        return resolve_kv_cache_dtype(self.cache.kv_cache_dtype, self.model.dtype)

    @property
    def kv_bytes_per_slot(self) -> int:
        """Bytes of one physical cache slot (one token, all layers) on one rank; a draft model's cache
        uses the same block ids, so its slot (in the draft's dtype) counts too, as does an MTP module's."""
        slot = self.kv_cache_spec.bytes_per_slot(self.kv_cache_dtype)
        draft = self.speculative.draft_model_config if self.speculative is not None else None
        if draft is not None:
            slot += kv_cache_spec(draft, self.parallel.attention_tp_size).bytes_per_slot(draft.dtype)
        if self.speculative is not None and self.speculative.method == "mtp":
            slot += self.mtp_kv_cache_spec.bytes_per_slot(self.model.dtype)
        return slot

    @property
    def mtp_kv_cache_spec(self) -> KVCacheSpec:
        """The MTP module's cache: one more layer of the target's, in the model's dtype."""
        return dataclasses.replace(self.kv_cache_spec, num_layers=1)

    @property
    def num_kv_blocks(self) -> int:
        if self.cache.num_kv_blocks is not None:
            return self.cache.num_kv_blocks
        return self.cache.kv_cache_memory // (self.cache.block_size * self.kv_bytes_per_slot)

    @property
    def tokens_per_virtual_block(self) -> int:
        return self.dcp_layout.tokens_per_virtual_block

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.tokens_per_virtual_block

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens that fit at once (vLLM's 'Maximum concurrency')."""
        blocks_per_request = -(-self.scheduler.max_model_len // self.tokens_per_virtual_block)
        return self.num_kv_blocks / blocks_per_request

    def layout_report(self, compile_seconds: float | None = None) -> str:
        """The start-up report (kvshard/config/report.py); `compile_seconds`: the model step's compile time."""
        from kvshard.config.report import startup_report

        return startup_report(self, compile_seconds)
