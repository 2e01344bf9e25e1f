"""Configuration errors: a message that says what to change, and no process started."""

from __future__ import annotations

import json
import multiprocessing

import pytest
from transformers import LlamaConfig

from kvshard import LLM, ConfigError
from kvshard.config import EngineConfig, parse_memory_size


def _tiny_llama(num_kv_heads: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=256,
                       architectures=["LlamaForCausalLM"])


@pytest.fixture(scope="module")
def one_kv_head(checkpoints):
    return checkpoints("config-llama", _tiny_llama(1))


@pytest.fixture(scope="module")
def two_kv_heads(checkpoints):
    return checkpoints("config-llama-2kv", _tiny_llama(2))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"decode_context_parallel_size": 0}, "decode_context_parallel_size must be a positive integer"),
        ({"tensor_parallel_size": 4, "decode_context_parallel_size": 3}, "not divisible by decode_context_parallel_size=3"),
        ({"tensor_parallel_size": 2, "decode_context_parallel_size": 2, "block_size": 6, "dcp_kv_interleave_size": 4},
         "block_size=6 is not a multiple of dcp_kv_interleave_size=4"),
        ({"tensor_parallel_size": 3}, "not divisible by tensor_parallel_size=3"),
        ({"kv_cache_memory": "lots"}, "is not a size"),
        ({"kv_cache_memory": "1KiB"}, "fewer than one request of max_model_len"),
        ({"max_model_len": 100000}, "exceeds the model's max_position_embeddings"),
        ({"dtype": "int3"}, "dtype='int3' is not supported"),
    ],
)
def test_bad_configuration_is_rejected_with_what_to_change(one_kv_head, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(one_kv_head), **kwargs)
    assert multiprocessing.active_children() == []


def test_gqa_dcp_beyond_kv_head_replicas_is_rejected(two_kv_heads):
    # tp=4 over 2 KV heads: each head has 2 replicas, so a DCP group can have at most 2 ranks
    with pytest.raises(ConfigError, match=r"exceeds tp / num_kv_heads = 4/2 = 2: .*--dcp 2"):
        LLM(str(two_kv_heads), tensor_parallel_size=4, decode_context_parallel_size=4)
    EngineConfig.create(two_kv_heads, tensor_parallel_size=4, decode_context_parallel_size=2)  # the fix works
    assert multiprocessing.active_children() == []


def test_missing_model_directory_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="never downloads weights"):
        LLM(str(tmp_path / "nope"))


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel.*supported: .*LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_interleave_comes_from_the_environment_and_the_flag_wins(one_kv_head, monkeypatch):
    monkeypatch.setenv("VLLM_DCP_KV_INTERLEAVE_SIZE", "4")
    assert EngineConfig.create(one_kv_head).parallel.dcp_kv_interleave_size == 4
    monkeypatch.setenv("KVSHARD_DCP_KV_INTERLEAVE_SIZE", "8")
    assert EngineConfig.create(one_kv_head).parallel.dcp_kv_interleave_size == 8
    assert EngineConfig.create(one_kv_head, dcp_kv_interleave_size=2).parallel.dcp_kv_interleave_size == 2
    monkeypatch.setenv("KVSHARD_DCP_KV_INTERLEAVE_SIZE", "x")
    with pytest.raises(ConfigError, match="KVSHARD_DCP_KV_INTERLEAVE_SIZE='x' is not an integer"):
        EngineConfig.create(one_kv_head)


def test_dcp_groups_are_contiguous_slices_of_tp(one_kv_head):
    config = EngineConfig.create(one_kv_head, tensor_parallel_size=4, decode_context_parallel_size=2)
    assert config.parallel.dcp_groups() == [[0, 1], [2, 3]]
    assert config.parallel.world_size == 4


def test_kv_budget_in_blocks_scales_capacity_with_dcp(one_kv_head):
    # per rank: 1 layer x 1 KV head x (K + V) x 8 dims x 4 bytes = 64 bytes per slot
    one = EngineConfig.create(one_kv_head, tensor_parallel_size=4, kv_cache_memory="64KiB", block_size=16)
    four = EngineConfig.create(one_kv_head, tensor_parallel_size=4, decode_context_parallel_size=4,
                               kv_cache_memory="64KiB", block_size=16)
    assert one.kv_bytes_per_slot == four.kv_bytes_per_slot == 64
    assert one.num_kv_blocks == four.num_kv_blocks == 64
    assert four.kv_capacity_tokens == 4 * one.kv_capacity_tokens == 4 * 64 * 16
    assert four.kv_bytes_per_token_per_rank == one.kv_bytes_per_token_per_rank / 4
    assert "Maximum concurrency for 256 tokens per request: 16.00x" in four.layout_report()


def test_memory_sizes_parse_with_units():
    assert parse_memory_size("64MiB") == 64 * 2**20
    assert parse_memory_size("2GB") == 2 * 10**9
    assert parse_memory_size(1234) == 1234


def test_kimi_k2_config_is_read_as_deepseek_v3_without_remote_code(checkpoints, tmp_path):
    import shutil

    from transformers import DeepseekV3Config

    source = checkpoints("config-v3", DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        max_position_embeddings=256, architectures=["DeepseekV3ForCausalLM"]))
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = EngineConfig.create(tmp_path, tensor_parallel_size=4, decode_context_parallel_size=2)
    assert config.model.is_mla
    assert config.kv_bytes_per_slot == 1 * (16 + 8) * 4  # one layer, one latent of kv_lora + rope, float32
    assert "KV copies of each token across the 4 rank(s): 2 (replicated" in config.layout_report()
    full = EngineConfig.create(tmp_path, tensor_parallel_size=4, decode_context_parallel_size=4)
    assert "KV copies of each token across the 4 rank(s): 1" in full.layout_report()
