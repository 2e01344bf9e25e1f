"""DCP changes where K/V live, never the result (docs/design.md#verification).

Every configuration runs the same greedy batch (prompts shorter and longer than
one virtual block, mixed in one batch, some prefilled in chunks so that new
tokens also attend to cached context through the DCP rhythm) and must give the
tokens of transformers' `generate` and the log-probabilities of the same model
without DCP. Each configuration starts its ranks once (module-scoped cache).
"""

from __future__ import annotations

import pytest
from transformers import MistralConfig, Qwen2Config

from kvshard import SamplingParams
from kvshard.shm import shm_supported
from conftest import Run, assert_same_generation, tiny_llama_config

BLOCK = 4
NEW_TOKENS = 32
PROMPTS = [
    [3, 1, 4],  # shorter than a virtual block at every dcp
    [(7 * i) % 97 + 1 for i in range(40)],  # longer than a virtual block (4 * dcp tokens)
    [(5 * i) % 89 + 2 for i in range(17)],
]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)

# (tp, dcp, interleave, max_num_batched_tokens): tp in {1,2,4}, dcp in {1,2,4}, interleave in {1, B};
# a 16-token budget chunks the 40-token prompt, so chunks attend to cached context across ranks.
LLAMA_LAYOUTS = [
    (1, 1, 1, None), (2, 2, 1, None), (2, 2, BLOCK, 16), (4, 1, 1, None),
    (4, 2, 1, None), (4, 2, BLOCK, None), (4, 4, 1, 16), (4, 4, BLOCK, None),
]


MODELS = {
    "llama": lambda: tiny_llama_config(),
    "qwen2": lambda: tiny_llama_config(Qwen2Config, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"]),
    "mistral": lambda: tiny_llama_config(MistralConfig, sliding_window=None, tie_word_embeddings=True,
                                         architectures=["MistralForCausalLM"]),
}


def _run_args(tp: int, dcp: int, interleave: int, budget: int | None, attention: str, comm: str) -> dict:
    return dict(tensor_parallel_size=tp, decode_context_parallel_size=dcp, dcp_kv_interleave_size=interleave,
                dcp_attention_layout=attention, dcp_comm_backend=comm, block_size=BLOCK, max_num_seqs=8,
                max_num_batched_tokens=budget, kv_cache_memory="1MiB")


@pytest.fixture(scope="module")
def run(checkpoints, engine_run):
    """run(model, tp, dcp, ...) -> conftest.Run, each configuration's ranks started once per session."""

    def get(model: str, tp: int, dcp: int, interleave: int = 1, budget: int | None = None,
            attention: str = "auto", env: dict | None = None, comm: str = "auto") -> Run:
        result = engine_run(checkpoints(model, MODELS[model]()), PROMPTS, GREEDY, env=env,
                            **_run_args(tp, dcp, interleave, budget, attention, comm))
        assert result.blocks_used_after == 0
        return result

    return get


@pytest.fixture(scope="module")
def reference(checkpoints, hf_reference):
    def get(model: str) -> list[list[int]]:
        return hf_reference(checkpoints(model, MODELS[model]()), PROMPTS, NEW_TOKENS)

    return get


def assert_same_as(got: Run, want: Run) -> None:
    """The same greedy tokens, top-3 candidates and log-probabilities (up to float rounding)."""
    assert all(len(tokens) == NEW_TOKENS for tokens in got.tokens)
    assert_same_generation(got.tokens, got.logprobs, want.tokens, want.logprobs, atol=1e-4)


@pytest.mark.parametrize("tp, dcp, interleave, budget", LLAMA_LAYOUTS)
def test_llama_matches_transformers_and_no_dcp(run, reference, tp, dcp, interleave, budget):
    result = run("llama", tp, dcp, interleave, budget)
    # where it applies, auto keeps the Q all-gather layout
    assert result.config.parallel.attention_layout == "head-split"
    assert result.tokens == reference("llama")
    assert_same_as(result, run("llama", 1, 1))


@pytest.mark.parametrize("model, tp, dcp, interleave", [
    ("qwen2", 1, 1, 1), ("qwen2", 4, 2, 1), ("mistral", 1, 1, 1), ("mistral", 4, 4, BLOCK),
])
def test_qwen2_and_mistral_match_transformers(run, reference, model, tp, dcp, interleave):
    result = run(model, tp, dcp, interleave)
    assert result.tokens == reference(model)
    assert_same_as(result, run(model, 1, 1))


@pytest.mark.parametrize("tp, dcp, interleave, budget", [(4, 4, 1, 16), (4, 2, BLOCK, None)])
def test_replicated_queries_change_nothing(run, tp, dcp, interleave, budget):
    """Each rank computes its whole group's queries instead of all-gathering them."""
    result = run("llama", tp, dcp, interleave, budget, attention="replicated")
    assert result.config.parallel.attention_layout == "replicated"
    assert result.tokens == run("llama", tp, dcp, interleave, budget).tokens
    assert_same_as(result, run("llama", 1, 1))


# Tiny models' merges are small: --dcp-comm-backend auto takes the all-to-all, ag_rs its fused
# all-gather; both merge the same [output | lse] rows in the same order, so the bits are equal.
@pytest.mark.parametrize("tp, dcp, interleave, budget", [(2, 2, 1, None), (4, 4, BLOCK, None), (4, 2, 1, None)])
def test_all_to_all_merge_equals_ag_rs_bit_for_bit(run, reference, tp, dcp, interleave, budget):
    a2a, ag_rs = run("llama", tp, dcp, interleave, budget), run("llama", tp, dcp, interleave, budget, comm="ag_rs")
    assert a2a.merges == {"a2a"} and ag_rs.merges == {"ag_rs fused"}
    assert a2a.tokens == ag_rs.tokens == reference("llama")
    assert a2a.logprobs == ag_rs.logprobs


# gloo alone; and shared-memory slots so small that the prefill's activations go through gloo while
# the decodes' go through shared memory (both paths within one step sequence), each against the same
# layout's run in LLAMA_LAYOUTS. tp=4, dcp=2 has the TP all-reduce over all ranks and DCP groups that are
# a part of them; at tp=2, dcp=2 the DCP group shares TP's segment, which only the mixed run can tell
# apart (with gloo alone there is no segment), and its 16-token budget chunks the prefill.
GLOO = {"KVSHARD_SHM_COLLECTIVES": "0"}
MIXED = {"KVSHARD_SHM_SLOT_BYTES": "2048"}


@pytest.mark.parametrize("tp, dcp, interleave, budget, collectives", [
    (4, 2, 1, None, GLOO), (4, 2, 1, None, MIXED), (2, 2, BLOCK, 16, MIXED),
], ids=["tp4-dcp2-gloo", "tp4-dcp2-mixed", "tp2-dcp2-i4-mixed"])
def test_gloo_and_shared_memory_collectives_agree(run, tp, dcp, interleave, budget, collectives):
    default = run("llama", tp, dcp, interleave, budget)
    assert default.shared_memory == shm_supported()
    other = run("llama", tp, dcp, interleave, budget, env=collectives)
    assert other.shared_memory == (collectives is MIXED and shm_supported())
    assert_same_as(other, default)


# Tiny models never reach the canonical merge (a rank's partial output above 256 KiB) nor decode
# groups split by length (contexts 1,024 tokens apart): at 0 every merge takes the LSE all-gather +
# ReduceScatter path, and decodes of different local lengths attend in groups of their own.
CANONICAL_MERGE_AND_SPLIT_GROUPS = {"KVSHARD_FUSED_MERGE_MAX_BYTES": "0", "KVSHARD_A2A_MAX_BYTES": "0",
                                    "KVSHARD_DECODE_GROUP_SPREAD": "0"}


def test_canonical_merge_and_split_decode_groups_match_transformers(run, reference):
    result = run("llama", 4, 4, 1, 16, env=CANONICAL_MERGE_AND_SPLIT_GROUPS)
    assert result.tokens == reference("llama")
    assert_same_as(result, run("llama", 1, 1))


def test_per_rank_kv_memory_at_dcp_n_is_one_nth(run):
    """Bytes of KV a rank holds for the same requests, from the engine's own block accounting."""
    base = run("llama", 4, 1)
    for dcp, interleave in [(2, 1), (4, 1), (4, BLOCK)]:
        sharded = run("llama", 4, dcp, interleave)
        assert sharded.config.kv_bytes_per_slot == base.config.kv_bytes_per_slot  # same bytes per stored token ...
        used = sharded.peak_blocks * BLOCK * sharded.config.kv_bytes_per_slot
        full = base.peak_blocks * BLOCK * base.config.kv_bytes_per_slot
        # ... but 1/N of the tokens, up to one partly filled block per request
        assert full / dcp <= used <= full / dcp + len(PROMPTS) * BLOCK * base.config.kv_bytes_per_slot
        total = sum(base.peak_tokens_per_rank)
        assert sum(sharded.peak_tokens_per_rank) == total
        assert max(sharded.peak_tokens_per_rank) <= total / dcp + len(PROMPTS) * interleave


def test_allocated_cache_equals_the_configured_budget(run):
    result = run("llama", 4, 4, 1, 16)
    assert result.kv_cache_bytes == result.config.num_kv_blocks * BLOCK * result.config.kv_bytes_per_slot <= 2**20
