"""The start-up report: how an `EngineConfig` lays out the model over its ranks and what its KV cache holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvshard import envs
from kvshard.config.layout_rules import HEAD_SPLIT
from kvshard.config.settings import LPM

if TYPE_CHECKING:
    from kvshard.config.engine import EngineConfig


def _prefix_caching_report(config: EngineConfig) -> str:
    if not config.cache.enable_prefix_caching:
        return "Prefix caching: off (every prompt is computed in full)"
    dcp = config.parallel.decode_context_parallel_size
    # a block id names one physical block on every rank of the group: a hit must cover all of them
    unit = (f"whole virtual blocks of {config.tokens_per_virtual_block} tokens "
            f"(block size {config.cache.block_size} x dcp {dcp})" if dcp > 1
            else f"whole blocks of {config.cache.block_size} tokens")
    order = ("waiting requests with the longest cached prefix first (--scheduling-policy lpm)"
             if config.scheduler.policy == LPM else "waiting requests in arrival order")
    return f"Prefix caching: on, a shared prompt prefix is reused in {unit}; {order}"


def startup_report(config: EngineConfig, compile_seconds: float | None = None) -> str:
    """What `serve` and `generate` print before the first request: the layout, KV accounting, prefix
    caching, speculative decoding, and the numerics settings taken from the environment; with
    `compile_seconds` (once the engine started), how long compiling the model step took."""
    p = config.parallel
    lines = [
        f"model: {config.model.path} ({config.model.architecture}, {'MLA' if config.model.is_mla else 'GQA'}, "
        f"dtype {str(config.model.dtype).removeprefix('torch.')})",
        f"max model len: {config.scheduler.max_model_len:,} tokens"
        + (f" ({config.max_model_len_source})" if config.max_model_len_source else ""),
        config.generation.describe(),
        f"ranks: {p.world_size} (tp={p.tensor_parallel_size}, dcp={p.decode_context_parallel_size}, "
        f"interleave={p.dcp_kv_interleave_size}); DCP groups: {p.dcp_groups()}",
        _attention_line(config),
        _attention_backend_line(config.attention_backend, config.model.dtype),
        _decode_graphs_line(config),
        _compilation_line(config, compile_seconds),
        _elementwise_line(config),
        f"KV cache dtype: {str(config.kv_cache_dtype).removeprefix('torch.')}; "
        f"KV bytes per token per rank: {config.kv_bytes_per_token_per_rank:,.1f} "
        f"({config.kv_bytes_per_slot:,} per slot, {config.model.num_layers} layers, "
        f"{config.kv_heads_per_rank} KV head(s) per rank)",
        f"KV blocks per rank: {config.num_kv_blocks:,} of {config.cache.block_size} tokens "
        f"({config.num_kv_blocks * config.cache.block_size * config.kv_bytes_per_slot / 2**20:,.1f} MiB per rank)",
        _kv_pages_line(),
        _weight_pages_line(),
        f"KV capacity: {config.kv_capacity_tokens:,} tokens",
        f"Maximum concurrency for {config.scheduler.max_model_len:,} tokens per request: "
        f"{config.max_concurrency:.2f}x",
        f"KV copies of each token across the {p.world_size} rank(s): {config.kv_copies_per_token}"
        + (" (replicated: raise --dcp to shard instead)" if config.kv_copies_per_token > 1 else ""),
        _prefix_caching_report(config),
    ]
    if config.model.is_mla:
        lines.append(_mla_context_line(config))
    experts = _experts_line(config)
    if experts is not None:
        lines.append(experts)
    if config.speculative is not None:
        lines.append(config.speculative.describe())
    lines.extend(f"accepted, changes nothing: {note}" for note in config.notes)
    lines.append(envs.numerics_report())  # last: which KVSHARD_* settings that change numerics are set
    return "\n".join(lines)


def _experts_line(config: EngineConfig) -> str | None:
    """How a MoE model's routed experts split over the ranks; None for a model without them."""
    cfg, tp = config.model.hf_config, config.parallel.tensor_parallel_size
    routed = config.model.routed_experts
    if not routed:
        return None
    width = cfg.moe_intermediate_size
    if tp == 1:
        return f"routed experts: all {routed} whole on the one rank"
    if config.parallel.enable_expert_parallel:
        return (f"routed experts: expert parallel, {routed // tp} whole experts of the {routed} per rank "
                "(--enable-expert-parallel; a step waits for the rank whose experts got the most tokens)")
    return (f"routed experts: each of the {routed} split over the {tp} rank(s) by width ({width // tp} of its "
            f"{width} intermediate rows per rank; --enable-expert-parallel puts whole experts on each rank)")


def _mla_context_line(config: EngineConfig) -> str:
    from kvshard.models.deepseek import describe_cached_context

    return describe_cached_context(config.model.hf_config, config.batch_invariant)


def _compilation_line(config: EngineConfig, compile_seconds: float | None) -> str:
    from kvshard.compilation import describe_compilation

    return describe_compilation(config, compile_seconds)


def _kv_pages_line() -> str:
    from kvshard.kv.cache import describe_kv_pages

    return describe_kv_pages()


def _weight_pages_line() -> str:
    from kvshard.host_pages import describe_weight_pages

    return describe_weight_pages()


def _elementwise_line(config: EngineConfig) -> str:
    from kvshard.layers.fused import describe

    return describe(config)


def _decode_graphs_line(config: EngineConfig) -> str:
    import torch

    from kvshard.engine.cuda_graphs import describe_decode_graphs
    from kvshard.models.decode_program import describe_decode_program

    return describe_decode_graphs(config) if torch.cuda.is_available() else describe_decode_program(config)


def _attention_backend_line(name: str, dtype) -> str:
    from kvshard.attention.backends import describe_backend

    return describe_backend(name, dtype)


def _attention_line(config: EngineConfig) -> str:
    p, model = config.parallel, config.model
    heads = (f"{model.num_heads // p.attention_tp_size} query heads per DCP group, "
             f"{config.query_heads_per_rank} computed per rank")
    if p.decode_context_parallel_size == 1:
        return f"attention: TP over all {p.world_size} rank(s), {heads}"
    if p.attention_layout == HEAD_SPLIT:
        how = "queries split over all ranks, all-gathered in the group"
    else:
        how = (f"every rank computes its group's queries (replicated projections: "
               f"+{config.replicated_projection_bytes_per_rank / 2**20:,.2f} MiB per rank, no Q all-gather)")
    return (f"attention layout: {p.attention_layout} (attention-TP A={p.attention_tp_size}; {heads}; {how}); "
            f"DCP merge: --dcp-comm-backend {p.dcp_comm_backend}")

