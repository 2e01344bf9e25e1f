"""Loading checkpoints as users bring them: Qwen3, MLP biases, sharded weights beside other copies of them,
PyTorch `.bin` weights, generation_config.json's end-of-sequence ids, and the settings kvshard refuses.

Tiny random checkpoints written by transformers' save_pretrained; kvshard must give transformers' greedy tokens
and log-probabilities on the same weights, or refuse the checkpoint in one line that says what is wrong.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, Qwen3Config

from kvshard import LLM, ConfigError, SamplingParams
from kvshard.config.model_dir import load_model_config

from conftest import assert_same_generation, random_hf_model, tiny_llama_config

PROMPTS = [[3, 1, 4, 1, 5], [(7 * i) % 97 + 1 for i in range(21)]]
NEW_TOKENS = 8
LLAMA_SEED = 1  # transformers' greedy choices at least 1e-2 apart (conftest.hf_greedy_with_logprobs)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)


def generate(model, prompts=PROMPTS, params=GREEDY, **engine_kwargs):
    with LLM(str(model), block_size=4, **engine_kwargs) as llm:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_matches_transformers(model, hf_reference, **engine_kwargs) -> None:
    want_tokens, want_steps = hf_reference(model, PROMPTS, NEW_TOKENS, logprobs=True)
    outputs = generate(model, **engine_kwargs)
    want_logprobs = [[{t: step[t].item() for t in range(step.shape[0])} for step in steps] for steps in want_steps]
    assert_same_generation([o.token_ids for o in outputs], [o.logprobs for o in outputs], want_tokens,
                           want_logprobs, atol=1e-4, same_candidates=False)


@pytest.fixture(scope="module")
def llama(checkpoints):
    return checkpoints("probe-llama", tiny_llama_config(eos_token_id=2), seed=LLAMA_SEED, off_neutral=True)


@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}],
                         ids=["tp1", "tp2-dcp2"])
def test_qwen3_per_head_query_and_key_norms_match_transformers(checkpoints, hf_reference, layout):
    config = tiny_llama_config(Qwen3Config, num_key_value_heads=2, architectures=["Qwen3ForCausalLM"])
    # off_neutral: q_norm / k_norm weights away from 1, so that leaving them out changes the output
    model = checkpoints("probe-qwen3", config, off_neutral=True)
    assert_matches_transformers(model, hf_reference, kv_cache_memory="1MiB", **layout)


def test_llama_mlp_bias_and_head_dim_apart_from_hidden_over_heads_match_transformers(checkpoints, hf_reference):
    config = tiny_llama_config(mlp_bias=True, attention_bias=True, head_dim=32, num_key_value_heads=2)
    model = checkpoints("probe-llama-mlp-bias", config, off_neutral=True)
    assert_matches_transformers(model, hf_reference)


def test_an_index_names_the_weight_files_other_copies_beside_them_are_not_read(llama, hf_reference, tmp_path):
    """Mistral's repositories hold consolidated.safetensors (other names, the same weights) beside the shards
    that model.safetensors.index.json names: only the shards are read."""
    random_hf_model(tiny_llama_config(eos_token_id=2), LLAMA_SEED, off_neutral=True).save_pretrained(
        tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    tensors = load_file(llama / "model.safetensors")
    save_file({name.replace("model.", "").replace("self_attn.q_proj", "attention.wq"): t for name, t in tensors.items()},
              tmp_path / "consolidated.safetensors")
    assert_matches_transformers(tmp_path, hf_reference)


def test_an_index_that_names_a_missing_shard_is_refused(tmp_path):
    random_hf_model(tiny_llama_config()).save_pretrained(tmp_path, max_shard_size="40KB")
    shard = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    (tmp_path / shard).unlink()
    with pytest.raises(ConfigError, match=rf"names 1 weight files missing from .*, e\.g\. {shard}; the download is "
                                          "incomplete"):
        load_model_config(tmp_path)


def test_kv_scales_and_mtp_names_come_from_the_files_the_weights_do(tmp_path):
    """The FP8 KV scales and the MTP layer's tensor names were read from every *.safetensors file of the
    directory (a consolidated copy beside the indexed shards included), and never from .bin weights."""
    from kvshard.kv.cache import KVScales, load_kv_scales
    from kvshard.spec_decode.config import _tensor_names

    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale":
               torch.tensor(2.0)}, tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.layers.0.self_attn.k_scale": "model-00001-of-00001.safetensors",
                        "model.layers.0.self_attn.v_scale": "model-00001-of-00001.safetensors"}}))
    save_file({"layers.0.attention.k_scale": torch.ones(4), "model.layers.1.mtp.weight": torch.zeros(1)},
              tmp_path / "consolidated.safetensors")  # another layout's copy: not the weights kvshard reads
    assert load_kv_scales(tmp_path, 2) == [KVScales(0.5, 2.0), KVScales(1.0, 1.0)]
    assert "model.layers.1.mtp.weight" not in _tensor_names(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torch.save({"model.layers.1.self_attn.kv_scale": torch.tensor(4.0), "model.layers.2.eh_proj.weight":
                torch.zeros(1)}, bin_dir / "pytorch_model.bin")
    assert load_kv_scales(bin_dir, 2) == [KVScales(1.0, 1.0), KVScales(4.0, 4.0)]
    assert "model.layers.2.eh_proj.weight" in _tensor_names(bin_dir)


def test_pytorch_bin_weights_load(llama, hf_reference, tmp_path):
    for name in ("config.json", "generation_config.json"):
        shutil.copy(llama / name, tmp_path / name)
    torch.save(load_file(llama / "model.safetensors"), tmp_path / "pytorch_model.bin")
    (tmp_path / "training_args.bin").write_bytes(b"not weights")  # what a fine-tuning run leaves beside them
    assert_matches_transformers(tmp_path, hf_reference)


def test_generation_config_eos_ids_end_generation(llama, tmp_path):
    """Llama 3 instruct checkpoints name <|eot_id|> in generation_config.json's eos_token_id list only."""
    free = generate(llama, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))[0]
    assert free.finish_reason == "length" and 2 not in free.token_ids
    stop_at = next(i for i in range(1, NEW_TOKENS) if free.token_ids[i] not in free.token_ids[:i])
    shutil.copytree(llama, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, free.token_ids[stop_at]]}))
    assert load_model_config(tmp_path).hf_config.eos_token_id == [2, free.token_ids[stop_at]]
    stopped = generate(tmp_path, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: stop_at + 1]
    ignoring = generate(tmp_path, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert ignoring[0].token_ids == free.token_ids


def test_a_generation_config_eos_outside_the_vocabulary_is_refused(llama, tmp_path):
    shutil.copytree(llama, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 128000]}))
    with pytest.raises(ConfigError, match=r"generation_config\.json: eos_token_id=\[2, 128000\] must be a token id"):
        load_model_config(tmp_path)


def test_a_text_prompt_to_a_checkpoint_without_tokenizer_says_to_pass_token_ids(llama):
    with LLM(str(llama), block_size=4) as engine:
        with pytest.raises(ValueError, match="has no tokenizer .*: pass prompts as token ids"):
            engine.generate(["Hello"], GREEDY, use_tqdm=False)


def test_a_tensor_the_model_has_no_place_for_is_a_config_error(llama, tmp_path):
    shutil.copytree(llama, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"'model\.layers\.1\.mlp\.extra\.weight' in .* has no place in "
                                          r"LlamaForCausalLM: the checkpoint does not match its config\.json"):
        LLM(str(tmp_path), block_size=4)


_V3 = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
           max_position_embeddings=256, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
           first_k_dense_replace=1, q_lora_rank=None, n_shared_experts=1, n_group=2, topk_group=1)


@pytest.mark.parametrize("field, value, model", [
    ("moe_layer_freq", 2, "v3"),  # DeepSeek's own code makes every second layer dense; transformers ignores it
    ("scoring_func", "softmax", "v3"),
    ("topk_method", "greedy", "v3"),
    ("hidden_act", "gelu", "llama"),
])
def test_settings_kvshard_does_not_implement_are_refused_before_any_rank_starts(checkpoints, llama, tmp_path, field,
                                                                               value, model):
    source = checkpoints("probe-v3", DeepseekV3Config(**_V3)) if model == "v3" else llama
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    load_model_config(tmp_path)  # as saved: accepted
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ConfigError, match=rf"config\.json: {field}='?{value}'? is not supported by kvshard's"):
        load_model_config(tmp_path)
