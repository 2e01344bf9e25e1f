"""Configuration errors: a message that says what to change, and no process started."""

from __future__ import annotations

import argparse
import json
import multiprocessing

import pytest
from transformers import LlamaConfig

from kvshard import LLM, ConfigError
from kvshard.config import EngineConfig, parse_memory_size
from kvshard.engine.arg_utils import EngineArgs


def _tiny_llama(num_kv_heads: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=256,
                       architectures=["LlamaForCausalLM"])


def _config(model, **kwargs) -> EngineConfig:
    return EngineArgs(str(model), **kwargs).create_engine_config()


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
        ({"tensor_parallel_size": 4, "decode_context_parallel_size": 3},
         "decode_context_parallel_size=3 does not divide tensor_parallel_size=4: .*use --dcp 1 or 2 or 4"),
        ({"tensor_parallel_size": 2, "decode_context_parallel_size": 2, "block_size": 6, "dcp_kv_interleave_size": 4},
         "block_size=6 is not a multiple of dcp_kv_interleave_size=4"),
        ({"tensor_parallel_size": 3}, "does not split over tensor_parallel_size=3"),
        ({"kv_cache_memory": "lots"}, "is not a size"),
        ({"kv_cache_memory": "1KiB"}, "fewer than one request of max_model_len"),
        ({"max_model_len": 100000}, "exceeds the model's max_position_embeddings"),
        ({"dtype": "int3"}, "dtype='int3' is not supported"),
        # a switch or a number given as text reads as neither: "no" would have switched it on
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching='no' must be True or False"),
        ({"batch_invariant": "false"}, "batch_invariant='false' must be True or False"),
        ({"seed": "x"}, "seed='x' must be an integer"),
        ({"seed": 1.5}, "seed=1.5 must be an integer"),
        ({"seed": 2**70}, r"seed must be an integer in \[-9223372036854775808, 9223372036854775807\], got 1180591"),
        ({"block_size": None}, "block_size needs a value"),
    ],
)
def test_bad_configuration_is_rejected_with_what_to_change(one_kv_head, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(one_kv_head), **kwargs)
    assert multiprocessing.active_children() == []


def test_gqa_dcp_beyond_kv_head_replicas_needs_the_replicated_layout(two_kv_heads):
    # tp=4 over 2 KV heads: each head has 2 replicas, so a head-split DCP group can have at most 2 ranks
    with pytest.raises(ConfigError, match=r"dcp <= tp / num_kv_heads = 4/2\).*--dcp-attention-layout replicated"):
        LLM(str(two_kv_heads), tensor_parallel_size=4, decode_context_parallel_size=4,
            dcp_attention_layout="head-split")
    assert _config(two_kv_heads, tensor_parallel_size=4, decode_context_parallel_size=2).parallel.attention_layout \
        == "head-split"
    # auto: the group of 4 computes both KV heads, each rank caching 1/4 of the tokens
    wide = _config(two_kv_heads, tensor_parallel_size=4, decode_context_parallel_size=4)
    assert wide.parallel.attention_layout == "replicated" and wide.kv_heads_per_rank == 2
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
    assert _config(one_kv_head).parallel.dcp_kv_interleave_size == 4
    monkeypatch.setenv("KVSHARD_DCP_KV_INTERLEAVE_SIZE", "8")
    assert _config(one_kv_head).parallel.dcp_kv_interleave_size == 8
    assert _config(one_kv_head, dcp_kv_interleave_size=2).parallel.dcp_kv_interleave_size == 2
    monkeypatch.setenv("KVSHARD_DCP_KV_INTERLEAVE_SIZE", "x")
    with pytest.raises(ConfigError, match="KVSHARD_DCP_KV_INTERLEAVE_SIZE='x' is not an integer"):
        _config(one_kv_head)


def test_dcp_groups_are_contiguous_slices_of_tp(one_kv_head):
    config = _config(one_kv_head, tensor_parallel_size=4, decode_context_parallel_size=2)
    assert config.parallel.dcp_groups() == [[0, 1], [2, 3]]
    assert config.parallel.world_size == 4


def test_kv_budget_in_blocks_scales_capacity_with_dcp(one_kv_head):
    # per rank: 1 layer x 1 KV head x (K + V) x 8 dims x 4 bytes = 64 bytes per slot
    one = _config(one_kv_head, tensor_parallel_size=4, kv_cache_memory="64KiB", block_size=16)
    four = _config(one_kv_head, tensor_parallel_size=4, decode_context_parallel_size=4,
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
    config = _config(tmp_path, tensor_parallel_size=4, decode_context_parallel_size=2)
    assert config.model.is_mla
    assert config.kv_bytes_per_slot == 1 * (16 + 8) * 4  # one layer, one latent of kv_lora + rope, float32
    assert "KV copies of each token across the 4 rank(s): 2 (replicated" in config.layout_report()
    full = _config(tmp_path, tensor_parallel_size=4, decode_context_parallel_size=4)
    assert "KV copies of each token across the 4 rank(s): 1" in full.layout_report()


# --- EngineArgs: each setting once, for the CLI and the Python API ---------------------------------

def _parsed(argv: list[str]) -> EngineArgs:
    return EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv))


def test_cli_defaults_are_the_dataclass_defaults():
    assert _parsed([]) == EngineArgs()


def test_flags_and_aliases_fill_the_same_fields():
    parsed = _parsed(["some-model", "-tp", "4", "--dcp", "2", "--dcp-kv-interleave-size", "4", "--dcp-replicate-q",
                      "--kv-cache-memory", "64MiB", "--max-model-len", "128", "--no-enable-prefix-caching"])
    assert parsed == EngineArgs("some-model", tensor_parallel_size=4, decode_context_parallel_size=2,
                                dcp_kv_interleave_size=4, dcp_attention_layout="replicated", kv_cache_memory="64MiB",
                                max_model_len=128, enable_prefix_caching=False)
    # --dcp-replicate-q is an alias of the layout setting, on the command line and as a keyword of LLM
    assert _parsed(["--dcp-replicate-q"]) == _parsed(["--dcp-attention-layout", "replicated"])
    assert EngineArgs.from_kwargs("m", dcp_replicate_q=True) == EngineArgs("m", dcp_attention_layout="replicated")
    assert EngineArgs.from_kwargs("m", dcp_replicate_q=False) == EngineArgs("m")
    assert _parsed(["-dcp", "2"]) == _parsed(["--decode-context-parallel-size", "2"])
    # what a child `kvshard serve` receives parses back to the same settings
    assert _parsed(["some-model", *parsed.to_cli_args()]) == parsed


@pytest.mark.parametrize("command", [["serve"], ["generate"], ["bench", "throughput"], ["bench", "decode-floor"]])
def test_every_engine_command_takes_every_engine_flag(command):
    from kvshard.entrypoints.cli import build_parser

    args = build_parser().parse_args([*command, "some-model", "--max-model-len", "99", "--no-enable-prefix-caching"])
    assert EngineArgs.from_cli_args(args) == EngineArgs("some-model", max_model_len=99, enable_prefix_caching=False)


def test_llm_keywords_are_the_engine_settings():
    assert EngineArgs.from_kwargs("m", dcp=2) == EngineArgs("m", decode_context_parallel_size=2)
    with pytest.raises(ConfigError, match="set the same thing"):
        EngineArgs.from_kwargs("m", dcp=2, decode_context_parallel_size=4)


def test_a_misspelt_llm_keyword_names_the_setting_meant(one_kv_head):
    with pytest.raises(TypeError, match="'max_model_length' is not an engine setting; did you mean max_model_len"):
        LLM(str(one_kv_head), max_model_length=64)
    assert multiprocessing.active_children() == []


def test_the_dcp_layout_is_one_object_built_from_the_config(one_kv_head):
    config = _config(one_kv_head, tensor_parallel_size=4, decode_context_parallel_size=2,
                     dcp_kv_interleave_size=4)
    layout = config.dcp_layout
    assert layout is config.dcp_layout
    assert (layout.block_size, layout.dcp_size, layout.interleave) == (16, 2, 4)


def test_a_spawned_rank_reads_the_model_config_without_importing_transformers(one_kv_head, tmp_path):
    import pickle
    import subprocess
    import sys

    config = EngineArgs(model=str(one_kv_head)).create_engine_config()
    hf = config.model.hf_config
    (tmp_path / "config.pkl").write_bytes(pickle.dumps(config))
    probe = ("import pickle, sys; import kvshard.engine.workers; "
             f"c = pickle.loads(open({str(tmp_path / 'config.pkl')!r}, 'rb').read()); "
             "h = c.model.hf_config; "
             "print(type(h).__name__, h.num_hidden_layers, h.num_key_value_heads, h.rope_parameters['rope_theta'], "
             "'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["SimpleNamespace", str(hf.num_hidden_layers), str(hf.num_key_value_heads),
                                   str(hf.rope_parameters["rope_theta"]), "False"]
    assert pickle.loads(pickle.dumps(config)).model.hf_config.vocab_size == hf.vocab_size  # attributes kept
