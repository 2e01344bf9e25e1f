"""`kvshard bench decode-floor` (kvshard/bench/decode_floor.py) times steps that decode the whole batch.

Chunked prefill gives the requests their first tokens steps apart; a budget of exactly the timed steps ended
the first requests while the timing still ran, so its last steps decoded an ever smaller batch (SmolLM2 at 32 x
1,024: 78 ms steps falling to 29 ms, reported as the best step). Every timed step must advance every request.
"""

from __future__ import annotations

import pytest

from kvshard.bench.decode_floor import format_decode_floor, measure_decode_floor
from kvshard.engine.arg_utils import EngineArgs
from kvshard.models.decode_program import program_unavailable

from conftest import tiny_llama_config

# one 24-token prompt per 32-token step: the four requests' prefills end steps apart
STAGGERED = dict(max_num_batched_tokens=32, max_num_seqs=4, block_size=4, kv_cache_memory="2MiB")


def test_every_timed_step_decodes_the_whole_batch(checkpoints):
    path = str(checkpoints("llama", tiny_llama_config()))
    args = EngineArgs(model=path, **STAGGERED)
    result = measure_decode_floor(args, batch_size=4, context_len=24, steps=6, warmup_steps=1, bandwidth_bytes=2**20)
    assert result["batch_size"] == 4 and result["steps"] == 6 and result["median_step_ms"] > 0
    # the timed steps attend to all four requests' prompts and more
    assert result["kv_bytes_per_step"] > 4 * 24 * args.create_engine_config().kv_bytes_per_token_per_rank
    # a float32 Llama at tp=1 on a CPU: its decode steps run as the flat program (models/decode_program.py) where the
    # machine has what it calls
    here = program_unavailable(args.create_engine_config(), "cpu") is None
    path = "a flat program of the kernel extension's calls" if here else "the layers' modules"
    assert result["decode_layers"] == path
    assert f"; decode steps' layers: {path}" in format_decode_floor(result)


def test_a_request_that_would_finish_while_timing_is_an_error_not_a_smaller_batch(checkpoints):
    # a window of 32 tokens leaves 8 after a 24-token prompt: the first request ends while the last still decodes
    path = str(checkpoints("llama", tiny_llama_config()))
    with pytest.raises(RuntimeError, match="a request left the decode batch while timing"):
        measure_decode_floor(EngineArgs(model=path, max_model_len=32, **STAGGERED), batch_size=4, context_len=24,
                             steps=6, warmup_steps=1, bandwidth_bytes=2**20)


def test_a_kv_cache_too_small_for_the_batch_is_refused_before_anything_starts(checkpoints):
    # preempted requests leave the batch (their steps would time a smaller one): refused up front, with the size
    path = str(checkpoints("llama", tiny_llama_config()))
    small = dict(STAGGERED, kv_cache_memory="24KiB", max_model_len=64)  # 96 tokens: one request fits, four do not
    with pytest.raises(ValueError, match=r"need about [\d,]+: pass --kv-cache-memory \d+MiB or more"):
        measure_decode_floor(EngineArgs(model=path, **small), batch_size=4, context_len=24, steps=6, warmup_steps=1,
                             bandwidth_bytes=2**20)


def _llama_multiply_adds(cfg, batch: int, kv_tokens: int) -> int:
    """A Llama decode step's multiply-adds at tp=1, counted from the config: the products with every weight (the
    LM head's whole matrix, tied or not), then attention's scores and weighted values over the context."""
    d, h, kv, hd, i = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                       cfg.intermediate_size)
    per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * i
    attention = cfg.num_hidden_layers * kv_tokens * h * 2 * hd
    return batch * (cfg.num_hidden_layers * per_layer + cfg.vocab_size * d) + attention


def test_the_compute_floor_counts_every_product_and_a_tied_head_whole(checkpoints):
    # (the tied head's bytes: tests/test_linear.py)
    cfg = tiny_llama_config(tie_word_embeddings=True)
    path = str(checkpoints("llama-tied", cfg))
    result = measure_decode_floor(EngineArgs(model=path, **STAGGERED), batch_size=4, context_len=24, steps=6,
                                  warmup_steps=1, bandwidth_bytes=2**20)
    kv_tokens = result["kv_bytes_per_step"] // EngineArgs(model=path, **STAGGERED).create_engine_config(
    ).kv_bytes_per_token_per_rank
    assert result["multiply_adds_per_step"] == _llama_multiply_adds(cfg, 4, kv_tokens)
    assert result["product_rate_gmacs"] > 0
    assert result["compute_floor_ms"] == pytest.approx(result["multiply_adds_per_step"] / result["product_rate_gmacs"]
                                                       / 1e6)


def test_the_compute_floor_of_an_mla_moe_model_counts_its_absorbed_attention_and_picked_experts(checkpoints):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        q_lora_rank=24, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, initializer_range=0.3,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        moe_intermediate_size=32, n_shared_experts=1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, architectures=["DeepseekV3ForCausalLM"])
    path = str(checkpoints("mla-moe-floor", cfg))
    args = EngineArgs(model=path, **STAGGERED)
    result = measure_decode_floor(args, batch_size=4, context_len=24, steps=6, warmup_steps=1, bandwidth_bytes=2**20)
    kv_tokens = result["kv_bytes_per_step"] // args.create_engine_config().kv_bytes_per_token_per_rank
    d, h, c, r, n, v = 64, 4, 32, 8, 16, 16
    attention = (d * 24 + 24 * h * (n + r)  # Q through its LoRA
                 + d * (c + r)  # the latent and the rotary key
                 + h * n * c + h * v * c  # W_UK into the latent, W_UV out of it (absorbed)
                 + h * v * d)  # the output
    dense = 3 * d * 96
    moe = 8 * d + 3 * d * 32 * (1 + 2)  # the router; the shared expert and the two picked of eight
    per_token = attention * 3 + dense + moe * 2 + 128 * d
    latent_attention = 3 * kv_tokens * h * ((c + r) + c)  # scores over latent + rotary, values over the latent
    assert result["multiply_adds_per_step"] == 4 * per_token + latent_attention
