"""Attention-TP decoupled from MLP TP (docs/design.md#parallel-layout): models whose heads the old rule
(tp divides the query heads, dcp <= tp / kv_heads) refused now run with DCP, exactly.

Each configuration starts its ranks once; the sharded runs must give transformers' greedy tokens
and the log-probabilities of tp=1 of the same checkpoint. The accounting and the refusals are
checked on EngineConfig alone (no process).
"""

from __future__ import annotations

import multiprocessing

import pytest

from kvshard import LLM, ConfigError, SamplingParams
from kvshard.config import (
    AUTO_REPLICATE_MAX_BYTES, HEAD_SPLIT, REPLICATED, EngineConfig, replicated_query_bytes_per_layer,
)
from kvshard.engine.arg_utils import EngineArgs
from kvshard.parallel import ParallelState
from conftest import Run, assert_same_generation, tiny_llama_config

BLOCK = 4
NEW_TOKENS = 12
PROMPTS = [[3, 1, 4], [(7 * i) % 97 + 1 for i in range(21)]]  # the longer one spans virtual blocks at dcp 2..8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)

MODELS = {
    # SmolLM2-135M's heads: 9 query over 3 KV heads, MLP 1,536 (it splits over 2, 3 and 6, not 9)
    "9q3kv": lambda: tiny_llama_config(num_attention_heads=9, num_key_value_heads=3, head_dim=8, hidden_size=72,
                                       intermediate_size=1536),
    "8q8kv": lambda: tiny_llama_config(num_attention_heads=8, num_key_value_heads=8, head_dim=8),
    "16q8kv": lambda: tiny_llama_config(num_attention_heads=16, num_key_value_heads=8, head_dim=4),
}

# Tiny models merge by one all-gather of [output | lse]; at 0 the merge takes the LSE all-gather +
# ReduceScatter of features, which hands a rank part of a head.
CANONICAL_MERGE = {"KVSHARD_FUSED_MERGE_MAX_BYTES": "0", "KVSHARD_A2A_MAX_BYTES": "0"}

# (model, tp, dcp, interleave, prefill budget): none of these passed the old rule. A 12-token budget
# prefills the 21-token prompt in chunks that attend to the cache across the group.
RUNS = [
    ("9q3kv", 2, 2, 1, 12),  # A=1: 9 heads' features split 36 / 36 over the group, mid-head (canonical merge)
    ("9q3kv", 3, 3, BLOCK, None),  # A=1: 3 heads each
    ("9q3kv", 6, 2, 1, None),  # A=3: 3 heads per group over 2 ranks, mid-head; MLP over 6
    ("8q8kv", 4, 4, BLOCK, 12),  # A=1: the whole group computes every KV head
    ("16q8kv", 8, 8, 1, 12),  # A=1 on 8 ranks
]


@pytest.fixture(scope="module")
def run(checkpoints, engine_run):
    """run(model, tp, dcp, ...) -> conftest.Run, each configuration's ranks started once per session."""

    def get(model: str, tp: int, dcp: int, interleave: int = 1, budget: int | None = None) -> Run:
        return engine_run(checkpoints(f"layouts-{model}", MODELS[model]()), PROMPTS, GREEDY,
                          env=CANONICAL_MERGE if (model, tp, dcp) == ("9q3kv", 2, 2) else {},
                          tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                          dcp_kv_interleave_size=interleave, block_size=BLOCK, max_num_seqs=4,
                          max_num_batched_tokens=budget, kv_cache_memory="256KiB", max_model_len=64)

    return get


@pytest.mark.parametrize("model, tp, dcp, interleave, budget", RUNS,
                         ids=[f"{m}-tp{t}-dcp{d}-i{i}" for m, t, d, i, _ in RUNS])
def test_sharded_run_matches_transformers_and_tp1(run, checkpoints, hf_reference, model, tp, dcp, interleave,
                                                  budget):
    sharded = run(model, tp, dcp, interleave, budget)
    assert sharded.config.parallel.attention_layout == REPLICATED  # head-split cannot run these
    single = run(model, 1, 1)
    assert sharded.tokens == single.tokens == hf_reference(checkpoints(f"layouts-{model}", MODELS[model]()), PROMPTS,
                                                            NEW_TOKENS)
    assert all(len(tokens) == NEW_TOKENS for tokens in sharded.tokens)
    assert_same_generation(sharded.tokens, sharded.logprobs, single.tokens, single.logprobs, atol=1e-4)


# --- which heads a rank computes (no process) -----------------------------------------------------

@pytest.mark.parametrize("heads, kv_heads, tp, dcp, layout", [
    (9, 3, 2, 2, REPLICATED), (9, 3, 6, 2, REPLICATED), (16, 8, 8, 8, REPLICATED), (8, 2, 8, 2, HEAD_SPLIT),
    (8, 1, 4, 4, HEAD_SPLIT), (8, 8, 4, 1, HEAD_SPLIT), (8, 8, 8, 2, REPLICATED),
])
def test_every_rank_of_a_group_reads_its_queries_kv_and_the_output_features_are_split_once(
        heads, kv_heads, tp, dcp, layout):
    dv = 8
    features: list[int] = []
    for rank in range(tp):
        state = ParallelState(rank=rank, world_size=tp, dcp_rank=rank % dcp, dcp_size=dcp,
                              dcp_group_index=rank // dcp, attention_layout=layout)
        mine = state.attention_heads(heads, kv_heads)
        a = tp // dcp
        assert len(mine.group) == heads // a and mine.group.start == (rank // dcp) * heads // a
        assert set(mine.output) <= set(mine.group)
        # every query head of the group reads one of the group's KV heads
        assert {h // (heads // kv_heads) for h in mine.group} <= set(mine.kv)
        if layout == REPLICATED:
            assert mine.query == mine.group and not mine.gathers_queries
        else:
            assert len(mine.query) == heads // tp and mine.gathers_queries == (dcp > 1)
        width = len(mine.group) * dv // dcp
        first = mine.group.start * dv + state.dcp_rank * width
        assert mine.output.start * dv <= first and first + width <= mine.output.stop * dv
        features += range(first, first + width)
    assert features == list(range(heads * dv))  # rank order = the output projection's row-parallel order


# --- accounting and refusals on EngineConfig (no process) -------------------------------------------

def _config(path, **kwargs) -> EngineConfig:
    """`LLM`'s keywords, aliases included, without starting anything."""
    return EngineArgs.from_kwargs(str(path), block_size=BLOCK, kv_cache_memory="64KiB", max_model_len=64,
                                  **kwargs).create_engine_config()


@pytest.mark.parametrize("model, tp, dcp, layout, kv_heads_per_rank", [
    ("9q3kv", 1, 1, HEAD_SPLIT, 3), ("9q3kv", 2, 2, REPLICATED, 3), ("9q3kv", 3, 3, REPLICATED, 3),
    ("9q3kv", 6, 2, REPLICATED, 1), ("8q8kv", 4, 4, REPLICATED, 8), ("8q8kv", 4, 1, HEAD_SPLIT, 2),
    ("8q8kv", 8, 2, REPLICATED, 2), ("16q8kv", 8, 8, REPLICATED, 8), ("16q8kv", 16, 2, HEAD_SPLIT, 1),
])
def test_kv_bytes_per_token_per_rank_follow_the_layout(checkpoints, model, tp, dcp, layout, kv_heads_per_rank):
    cfg = MODELS[model]()
    config = _config(checkpoints(f"layouts-{model}", cfg), tensor_parallel_size=tp, decode_context_parallel_size=dcp)
    assert config.parallel.attention_layout == layout
    head_bytes = cfg.num_hidden_layers * 2 * cfg.head_dim * 4  # K and V, float32
    # KV heads per attention-TP rank (A = tp / dcp; at least one), over the dcp ranks sharing the sequence
    assert max(1, cfg.num_key_value_heads // (tp // dcp)) == kv_heads_per_rank == config.kv_heads_per_rank
    assert config.kv_bytes_per_token_per_rank == kv_heads_per_rank / dcp * head_bytes
    report = config.layout_report()
    assert f"KV bytes per token per rank: {kv_heads_per_rank / dcp * head_bytes:,.1f}" in report
    if dcp > 1:
        assert f"attention layout: {layout} (attention-TP A={tp // dcp}" in report


@pytest.mark.parametrize("model, tp, dcps", [("9q3kv", 6, [2, 6]), ("8q8kv", 8, [1, 2, 4, 8])])
def test_capacity_in_tokens_scales_by_dcp_at_a_fixed_attention_tp(checkpoints, model, tp, dcps):
    """At fixed A = tp / dcp a rank holds the same KV heads per slot, so the same per-rank budget
    holds dcp times the tokens."""
    path = checkpoints(f"layouts-{model}", MODELS[model]())
    for dcp in dcps:
        base = _config(path, tensor_parallel_size=tp // dcp)  # the same attention-TP without DCP
        sharded = _config(path, tensor_parallel_size=tp, decode_context_parallel_size=dcp)
        assert sharded.kv_bytes_per_slot == base.kv_bytes_per_slot
        assert sharded.num_kv_blocks == base.num_kv_blocks
        assert sharded.kv_capacity_tokens == dcp * base.kv_capacity_tokens


def test_replicated_layout_reports_its_extra_query_weights(checkpoints):
    cfg = MODELS["8q8kv"]()
    path = checkpoints("layouts-8q8kv", cfg)
    wide = _config(path, tensor_parallel_size=8, decode_context_parallel_size=8, dcp_attention_layout="auto")
    # 8 KV heads, A=1: a group must compute all of them, so auto picks replicated
    assert wide.parallel.attention_layout == REPLICATED
    # 8 query and 8 KV heads (K and V) per rank instead of 1 and 1
    extra = cfg.num_hidden_layers * ((8 - 1) + 2 * (8 - 1)) * cfg.head_dim * cfg.hidden_size * 4
    assert wide.replicated_projection_bytes_per_rank == extra
    assert wide.query_heads_per_rank == 8
    one_kv = checkpoints("config-llama-4q1kv", tiny_llama_config())
    chosen = _config(one_kv, tensor_parallel_size=4, decode_context_parallel_size=4)
    asked = _config(one_kv, tensor_parallel_size=4, decode_context_parallel_size=4, dcp_replicate_q=True)
    assert chosen.parallel.attention_layout == HEAD_SPLIT and chosen.replicated_projection_bytes_per_rank == 0
    assert "attention layout: head-split" in chosen.layout_report()
    assert asked.parallel.attention_layout == REPLICATED and asked.query_heads_per_rank == 4
    assert "attention layout: replicated" in asked.layout_report()


def test_auto_replicates_the_queries_where_they_cost_a_rank_little(checkpoints, monkeypatch):
    one_kv = checkpoints("config-llama-4q1kv", tiny_llama_config())
    # replicated at tp=4 dcp=4: each rank computes 4 query heads instead of 1 (16 x 64 weights each)
    config = _config(one_kv, tensor_parallel_size=4, decode_context_parallel_size=4, dcp_attention_layout="head-split")
    per_layer = (4 - 1) * 16 * 64 * config.model.dtype.itemsize
    assert replicated_query_bytes_per_layer(config.model, 4, 4) == per_layer
    for limit, layout in ((per_layer, REPLICATED), (per_layer - 1, HEAD_SPLIT), (0, HEAD_SPLIT)):
        monkeypatch.setenv("KVSHARD_AUTO_REPLICATE_MAX_BYTES", str(limit))
        assert _config(one_kv, tensor_parallel_size=4, decode_context_parallel_size=4).parallel.attention_layout \
            == layout, limit
    monkeypatch.delenv("KVSHARD_AUTO_REPLICATE_MAX_BYTES")  # the default: far above a tiny model's queries
    assert per_layer < AUTO_REPLICATE_MAX_BYTES
    assert _config(one_kv, tensor_parallel_size=4, decode_context_parallel_size=4).parallel.attention_layout \
        == REPLICATED
    assert _config(one_kv, tensor_parallel_size=4).parallel.attention_layout == HEAD_SPLIT  # dcp = 1
    monkeypatch.setenv("KVSHARD_AUTO_REPLICATE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="KVSHARD_AUTO_REPLICATE_MAX_BYTES='lots' is not a non-negative integer"):
        _config(one_kv, tensor_parallel_size=4, decode_context_parallel_size=4)


@pytest.mark.parametrize("model, kwargs, message", [
    ("9q3kv", {"tensor_parallel_size": 4}, r"A = tp/dcp = 4/1 = 4 does not divide the model's 9 query heads: "
                                            r"at tensor_parallel_size=4 use --dcp 4"),
    ("9q3kv", {"tensor_parallel_size": 9, "decode_context_parallel_size": 3},
     r"MLP width \(intermediate_size\) 1,536 does not split over tensor_parallel_size=9: no dcp works"),
    ("9q3kv", {"tensor_parallel_size": 2, "decode_context_parallel_size": 2, "dcp_attention_layout": "head-split"},
     r"head-split needs tensor_parallel_size=2 to divide the 9 query heads: use --dcp-attention-layout replicated"),
    ("8q8kv", {"tensor_parallel_size": 8, "decode_context_parallel_size": 2, "dcp_attention_layout": "head-split"},
     r"same single KV head .*: use --dcp-attention-layout replicated"),
    ("16q8kv", {"tensor_parallel_size": 6, "decode_context_parallel_size": 2},
     r"MLP width .* does not split over tensor_parallel_size=6"),
    ("8q8kv", {"tensor_parallel_size": 2, "decode_context_parallel_size": 2, "dcp_attention_layout": "sideways"},
     r"dcp_attention_layout='sideways' is not one of auto, head-split, replicated"),
])
def test_layouts_no_view_can_run_are_refused_with_what_to_change(checkpoints, model, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(checkpoints(f"layouts-{model}", MODELS[model]())), block_size=BLOCK, **kwargs)
    assert multiprocessing.active_children() == []
