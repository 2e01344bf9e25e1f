"""GGUF files as llama.cpp's converter writes them for Llama 3, Qwen2/Qwen2.5, Mistral and SmolLM2.

Tiny random models (2 layers, hidden 64) are written in llama.cpp's layout with the features real files carry:
Llama 3's `rope_freqs` tensor and end-of-turn token, rope scaling keys (linear, YaRN), split files
(`NAME-00001-of-00002.gguf`), K-quant blocks, tied output weights. The original float model (or transformers
reading the same `.gguf` with `gguf_file=`) is the reference. Damaged and unsupported files are one-line errors.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

from conftest import environment, hf_greedy_with_logprobs
from kvshard import LLM, SamplingParams
from kvshard.config import ConfigError, load_model_config, resolve_model_path
from kvshard.models.demo import train_tokenizer
from test_gguf import add_hyperparameters, gguf_name, llama_cpp_rotary_rows, write_out

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192, rope_theta=500000.0)
# Llama 3's special tokens in place of the demo tokenizer's first five
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|system|>", "<|user|>"]
# a long prompt: rope scaling changes the low frequencies, whose angles grow with the position
LONG_PROMPT = [(7 * i + 3) % 500 + 5 for i in range(160)]


@pytest.fixture(scope="module", autouse=True)
def fresh_conversions(conversion_cache):
    with environment({"KVSHARD_CACHE_DIR": str(conversion_cache)}):
        yield


def tiny_config(model_type: str = "llama", **overrides):
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  initializer_range=0.2)
    fields.update(overrides)
    if model_type == "qwen2":
        return Qwen2Config(**fields, architectures=["Qwen2ForCausalLM"])
    return LlamaConfig(**fields, architectures=["LlamaForCausalLM"])


def random_model(config, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def llama3_rope_divisors(params: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter writes as `rope_freqs` for Llama 3.1's rope scaling."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * params["rope_theta"] ** (i / head_dim)
        low = params["original_max_position_embeddings"] / params["low_freq_factor"]
        high = params["original_max_position_embeddings"] / params["high_freq_factor"]
        if wavelength < high:
            factors.append(1.0)
        elif wavelength > low:
            factors.append(params["factor"])
        else:
            smooth = ((params["original_max_position_embeddings"] / wavelength - params["low_freq_factor"])
                      / (params["high_freq_factor"] - params["low_freq_factor"]))
            factors.append(1 / ((1 - smooth) / params["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path: Path, model, architecture: str = "llama", weight_type: Q = Q.F32, name: str = "tiny",
               specials: list[str] | None = None, eos: int = 1, add_bos: bool | None = None,
               metadata: dict | None = None, extra_tensors: dict | None = None, split_max_tensors: int = 0,
               raw_blocks=None) -> Path:
    """`model` as llama.cpp writes it. `raw_blocks(gguf_name, weights)` may return (bytes, type) for a matrix;
    `split_max_tensors` splits the file into shards of that many tensors (the output matrix last)."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture, split_max_tensors=split_max_tensors)
    writer.add_name(name)
    add_hyperparameters(writer, config)

    tokenizer = train_tokenizer(config.vocab_size)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    tokens = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    special = {t["id"] for t in spec["added_tokens"]}
    for i, text in enumerate(specials or []):
        tokens[i] = text
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe" if architecture == "llama" else "qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # 3: control
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(eos)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    for key, value in (metadata or {}).items():
        {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32}[type(value)](key, value)

    weights = model.state_dict()
    ordered = [n for n in weights if n != "lm_head.weight"] + (["lm_head.weight"] if "lm_head.weight" in weights
                                                               and not config.tie_word_embeddings else [])
    for hf_name in ordered:
        array = weights[hf_name].numpy()
        if architecture == "llama" and ".q_proj." in hf_name:
            array = llama_cpp_rotary_rows(array, config.num_attention_heads)
        elif architecture == "llama" and ".k_proj." in hf_name:
            array = llama_cpp_rotary_rows(array, config.num_key_value_heads)
        if array.ndim == 2 and raw_blocks is not None:
            blocks, block_type = raw_blocks(gguf_name(hf_name), array)
            writer.add_tensor(gguf_name(hf_name), blocks, raw_dtype=block_type)
        elif array.ndim == 1 or weight_type == Q.F32:
            writer.add_tensor(gguf_name(hf_name), np.ascontiguousarray(array))
        else:
            writer.add_tensor(gguf_name(hf_name), gguf.quants.quantize(array, weight_type), raw_dtype=weight_type)
    for tensor_name, array in (extra_tensors or {}).items():
        writer.add_tensor(tensor_name, array)
    write_out(writer)
    return path


def logits_of(directory_or_model, ids: list[int]) -> torch.Tensor:
    model = directory_or_model
    if isinstance(model, Path):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


# --- Llama 3.1/3.2: rope_freqs, end of turn, a split file whose output matrix is in the second shard ----------

@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """(original model, its float .gguf split in two shards, the converted directory)."""
    model = random_model(tiny_config(head_dim=16, rope_parameters=dict(LLAMA3_ROPE)), seed=3)
    directory = tmp_path_factory.mktemp("llama3")
    write_gguf(directory / "Llama-3.2-tiny.gguf", model, name="Llama 3.2 tiny", specials=LLAMA3_SPECIALS, eos=1,
               add_bos=True, extra_tensors={"rope_freqs.weight": llama3_rope_divisors(LLAMA3_ROPE, 16)},
               split_max_tensors=12)
    shards = sorted(directory.glob("*.gguf"))
    assert [s.name for s in shards] == ["Llama-3.2-tiny-00001-of-00002.gguf", "Llama-3.2-tiny-00002-of-00002.gguf"]
    return model, shards, resolve_model_path(shards[0])


def test_llama3_rope_freqs_become_its_rope_scaling(llama3):
    model, _, converted = llama3
    config = load_model_config(converted).hf_config
    assert {k: config.rope_parameters[k] for k in LLAMA3_ROPE} == LLAMA3_ROPE
    assert "rope_freqs.weight" not in load_file(converted / "model.safetensors")
    diff = (logits_of(converted, LONG_PROMPT) - logits_of(model, LONG_PROMPT)).abs().max().item()
    assert diff < 1e-4


def test_split_file_is_every_shard_with_the_output_matrix_of_the_last(llama3):
    model, shards, converted = llama3
    assert resolve_model_path(shards[1]) == converted  # any shard names the split file
    assert resolve_model_path(shards[0].parent) == converted  # as does the directory of its shards
    weights = load_file(converted / "model.safetensors")
    assert weights.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor), name
    assert json.loads((converted / "config.json").read_text())["tie_word_embeddings"] is False


def test_split_file_missing_a_shard_or_read_from_its_second_is_one_line(llama3, tmp_path):
    _, shards, _ = llama3
    alone = tmp_path / shards[0].name  # a copy: a link resolves to the folder of both shards
    alone.write_bytes(shards[0].read_bytes())
    with pytest.raises(ConfigError, match="lacks its shard.*00002-of-00002") as error:
        resolve_model_path(alone)
    assert "\n" not in str(error.value)
    renamed = tmp_path / "second.gguf"
    renamed.write_bytes(shards[1].read_bytes())
    with pytest.raises(ConfigError, match="no general.architecture") as error:
        resolve_model_path(renamed)
    assert "\n" not in str(error.value)
    first = tmp_path / "first.gguf"  # the first shard under another name: its split.count says what is missing
    first.write_bytes(shards[0].read_bytes())
    with pytest.raises(ConfigError, match="shard 1 of 2"):
        resolve_model_path(first)


def test_llama3_stops_at_end_of_turn_as_well_as_its_eos(llama3):
    _, _, converted = llama3
    assert load_model_config(converted).hf_config.eos_token_id == [1, 2]  # <|end_of_text|>, <|eot_id|>
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("Hello")[:1]) == ["<|begin_of_text|>"]


def test_llama3_engine_equals_the_original_model(llama3, tmp_path):
    model, _, converted = llama3
    model.save_pretrained(tmp_path)
    prompts = [LONG_PROMPT, LONG_PROMPT[:9]]
    want_tokens, want_logprobs = hf_greedy_with_logprobs(tmp_path, prompts, 4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    with LLM(str(converted), tensor_parallel_size=1, block_size=16, max_model_len=256) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, tokens, logprobs in zip(outputs, want_tokens, want_logprobs):
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        for step, top in enumerate(completion.logprobs):
            for token, value in top.items():
                assert abs(value - logprobs[step][token].item()) < 1e-4


def test_rope_freqs_other_than_llama3s_is_one_line(tmp_path):
    model = random_model(tiny_config(head_dim=16))
    path = write_gguf(tmp_path / "odd.gguf", model, extra_tensors={"rope_freqs.weight": np.full(8, 3.0, np.float32)})
    with pytest.raises(ConfigError, match="rope_freqs.weight tensor of 8 values that is not Llama 3") as error:
        resolve_model_path(path)
    assert "\n" not in str(error.value)


# --- rope scaling keys -------------------------------------------------------

@pytest.mark.parametrize("model_type, rope, keys", [
    ("llama", dict(rope_type="linear", factor=4.0), {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}),
    ("qwen2", dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
     {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64}),
], ids=["linear", "yarn"])
def test_rope_scaling_keys_are_read(tmp_path, model_type, rope, keys):
    model = random_model(tiny_config(model_type, rope_parameters=dict(rope, rope_theta=10000.0)))
    path = write_gguf(tmp_path / "scaled.gguf", model, architecture=model_type,
                      metadata={f"{model_type}.{key}": value for key, value in keys.items()})
    converted = resolve_model_path(path)
    assert {k: load_model_config(converted).hf_config.rope_parameters[k] for k in rope} == rope
    diff = (logits_of(converted, LONG_PROMPT) - logits_of(model, LONG_PROMPT)).abs().max().item()
    assert diff < 1e-4


def test_unknown_rope_scaling_is_one_line(tmp_path):
    model = random_model(tiny_config())
    path = write_gguf(tmp_path / "longrope.gguf", model, metadata={"llama.rope.scaling.type": "longrope",
                                                                    "llama.rope.scaling.factor": 2.0})
    with pytest.raises(ConfigError, match="rope.scaling.type='longrope'") as error:
        resolve_model_path(path)
    assert "\n" not in str(error.value)


# --- Qwen2.5, Mistral, K-quants ----------------------------------------------

def test_qwen25_file_tied_with_bias_and_im_end(tmp_path):
    model = random_model(tiny_config("qwen2", tie_word_embeddings=True))
    path = write_gguf(tmp_path / "Qwen2.5-tiny-Q8_0.gguf", model, architecture="qwen2", weight_type=Q.Q8_0,
                      specials=QWEN2_SPECIALS, eos=2, add_bos=False)
    converted = resolve_model_path(path)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    weights = load_file(converted / "model.safetensors")
    assert "lm_head.weight" not in weights and "model.layers.0.self_attn.q_proj.bias" in weights
    for name, tensor in reference.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(weights[name], tensor), name
    assert torch.equal(logits_of(converted, LONG_PROMPT[:32]), logits_of(reference, LONG_PROMPT[:32]))
    ours = AutoTokenizer.from_pretrained(converted)
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["Hello world", "<|im_start|>user\nhi<|im_end|>", " a  b\n\nc 12345"]:
        assert ours.encode(text) == theirs.encode(text)
    assert ours.encode("Hello")[0] != 0  # no BOS: add_bos_token is false
    assert load_model_config(converted).hf_config.eos_token_id == [2, 0]  # <|im_end|>, <|endoftext|>


def test_mistral_named_file_has_no_sliding_window(tmp_path):
    model = random_model(tiny_config())
    converted = resolve_model_path(write_gguf(tmp_path / "m.gguf", model, name="mistral"))
    config = load_model_config(converted)
    assert config.architecture == "MistralForCausalLM"
    assert config.hf_config.sliding_window is None  # llama.cpp attends to the whole context


# the float16 scales of each K-quant block (byte offsets), set to small values among random bytes
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


@pytest.mark.parametrize("block_type", list(K_QUANT_SCALES), ids=lambda t: t.name)
def test_k_quant_blocks_equal_transformers(tmp_path, block_type):
    rng = np.random.default_rng(0)

    def raw_blocks(_, weights):
        block, block_bytes = gguf.GGML_QUANT_SIZES[block_type]
        count = weights.size // block
        blocks = rng.integers(0, 256, (count, block_bytes), dtype=np.uint8)
        for offset in K_QUANT_SCALES[block_type]:
            scales = rng.uniform(1e-3, 2e-2, count).astype(np.float16)
            blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(count, 2)
        return blocks.reshape(weights.shape[0], -1), block_type

    model = random_model(tiny_config(hidden_size=256, intermediate_size=256, head_dim=64))
    path = write_gguf(tmp_path / f"tiny.{block_type.name}.gguf", model, raw_blocks=raw_blocks)
    weights = load_file(resolve_model_path(path) / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(weights[name], tensor), name
        assert torch.isfinite(tensor).all()


# --- damaged files, stale caches, two processes ------------------------------

@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("small") / "small.gguf", random_model(tiny_config()))


@pytest.mark.parametrize("cut", ["half", "last-bytes", "header", "garbage", "empty"])
def test_truncated_or_corrupt_file_is_one_line(small_gguf, tmp_path, cut):
    data = small_gguf.read_bytes()
    damaged = {"half": data[: len(data) // 2], "last-bytes": data[:-100], "header": data[:40],
               "garbage": b"GGUF" + bytes(range(256)) * 8, "empty": b""}[cut]
    path = tmp_path / "damaged.gguf"
    path.write_bytes(damaged)
    with pytest.raises(ConfigError, match="damaged.gguf cannot be read .*: it is truncated or corrupt") as error:
        resolve_model_path(path)
    assert "\n" not in str(error.value)


def test_changed_file_is_converted_again(tmp_path):
    path = tmp_path / "model.gguf"
    first = resolve_model_path(write_gguf(path, random_model(tiny_config(), seed=1)))
    second_model = random_model(tiny_config(), seed=2)
    second = resolve_model_path(write_gguf(path, second_model))
    assert first != second and first.is_dir()
    weights = load_file(second / "model.safetensors")
    assert torch.equal(weights["model.embed_tokens.weight"], second_model.state_dict()["model.embed_tokens.weight"])


def _convert_after(barrier, results, path: str) -> None:
    barrier.wait()
    results.put(str(resolve_model_path(path)))


def test_two_processes_converting_at_once_end_with_one_checkpoint(tmp_path):
    model = random_model(tiny_config(), seed=5)
    path = write_gguf(tmp_path / "shared.gguf", model)
    # spawned, not forked: a fork copies the test worker's locks as its other threads hold them (a child
    # deadlocked so once, its parent waited out the queue's timeout, and the children outlived the test)
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    processes = [context.Process(target=_convert_after, args=(barrier, results, str(path))) for _ in range(2)]
    try:
        for process in processes:
            process.start()
        directories = {results.get(timeout=120) for _ in processes}
        for process in processes:
            process.join(timeout=60)
            assert process.exitcode == 0
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    assert len(directories) == 1
    converted = Path(directories.pop())
    siblings = [p.name for p in converted.parent.iterdir() if p.name.startswith((".shared", "shared"))]
    assert siblings == [converted.name]  # no staging folder left behind
    weights = load_file(converted / "model.safetensors")
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor), name


def test_deepseek2_file_is_one_line(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "DeepSeek-V2-Lite.gguf"), "deepseek2")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    write_out(writer)
    with pytest.raises(ConfigError, match="architecture 'deepseek2'") as error:
        resolve_model_path(tmp_path / "DeepSeek-V2-Lite.gguf")
    assert "\n" not in str(error.value)


def test_cache_of_the_earlier_converter_is_not_reused(tmp_path):
    """Conversions made before rope scaling, split files and end-of-turn tokens were read are stale: an upgrade
    converts again instead of serving them."""
    from kvshard.models.demo import cache_dir
    from kvshard.models.gguf import file_sha256

    model = random_model(tiny_config(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0)))
    path = write_gguf(tmp_path / "upgraded.gguf", model,
                      metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    earlier = cache_dir() / "gguf" / f"upgraded-{file_sha256(path)[:16]}-v1"
    earlier.mkdir(parents=True)
    (earlier / "config.json").write_text(json.dumps({"rope_parameters": {"rope_type": "default"}}))
    converted = resolve_model_path(path)
    assert converted != earlier
    assert load_model_config(converted).hf_config.rope_parameters["rope_type"] == "linear"
