"""FP8 block-scaled checkpoints, in the layout DeepSeek-V3/R1 and Kimi K2 publish.

Each test checkpoint starts as a random transformers model; every linear that the public
DeepSeek-V3 checkpoint stores in FP8 is quantized here per 128x128 block (scale = amax / 448)
and written as float8_e4m3fn with its float32 `weight_scale_inv`; embeddings, norms, the
router gate and lm_head stay bfloat16, the routing bias float32, and config.json carries the
published `quantization_config`. The reference is the same model dequantized by this file
(not by kvshard) and written as a float32 checkpoint for transformers: transformers' own FP8
loader dequantizes on CPU too, but derives the block size from the scale grid, which is only
right when every dimension is a multiple of 128; the edge blocks here are partial on purpose.
Its block arithmetic is still checked against kvshard's on whole blocks.

The shapes make blocks straddle the tp=2 split: an intermediate size of 384 (three 128-row
blocks) gives each of two ranks 192 rows, so rows 128..255 of gate/up (and columns of down,
and of o_proj with 8 heads x 48) lie on both ranks.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, LlamaConfig

from kvshard import LLM, SamplingParams
from kvshard.config import ConfigError
from kvshard.engine.arg_utils import EngineArgs
from kvshard.models.quantization import Fp8BlockQuantization, QuantizedCheckpoint, dequantize_block_fp8

from conftest import random_hf_model

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}
# The linears the published DeepSeek-V3 checkpoint stores in FP8 (attention, dense MLP, routed and
# shared experts), and Llama's, which FP8 Llama checkpoints quantize alike.
FP8_LINEAR = re.compile(
    r"model\.layers\.\d+\..*\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|q_proj|k_proj|v_proj"
    r"|gate_proj|up_proj|down_proj)\.weight"
)
KV_BLOCK_SIZE = 4
NEW_TOKENS = 16
PROMPT_LENGTHS = [3, 21, 37]
LOGPROB_TOP = 5

CONFIGS = {
    # DeepSeek-V3 as published (Q LoRA, sigmoid routing with correction bias over expert groups,
    # shared expert, interleaved RoPE, YaRN), two layers: one dense, one MoE.
    "v3-moe": (DeepseekV3Config(
        vocab_size=128, hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=8, q_lora_rank=160, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=48, moe_intermediate_size=384, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_interleave=True, max_position_embeddings=256, bos_token_id=0,
        eos_token_id=1, initializer_range=0.2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8},
    ), 0),
    # MQA, so that tp=2 can run dcp=2.
    "llama": (LlamaConfig(
        vocab_size=128, hidden_size=160, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=40, max_position_embeddings=256, initializer_range=0.2,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    ), 0),
}
# (tp, dcp): unsharded, and tp=2 with dcp=2 (attention in one group, MLP and o_proj split over 2);
# V3 also at tp=2 without DCP, where q_b_proj (192 rows) and kv_b_proj are split by heads too.
RUNS = [("v3-moe", 1, 1), ("v3-moe", 2, 2), ("v3-moe", 2, 1), ("llama", 1, 1), ("llama", 2, 2)]


# --- building the checkpoints -------------------------------------------------------------------

def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [out, in] -> (float8_e4m3fn [out, in], float32 scales [ceil(out/128), ceil(in/128)])."""
    out_dim, in_dim = weight.shape
    rows, cols = math.ceil(out_dim / BLOCK), math.ceil(in_dim / BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK)
    padded[:out_dim, :in_dim] = weight
    blocks = padded.view(rows, BLOCK, cols, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [rows, cols]
    quantized = (blocks / scale[:, None, :, None]).view(rows * BLOCK, cols * BLOCK)[:out_dim, :in_dim]
    return quantized.to(torch.float8_e4m3fn), scale


def dequantize_reference(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each scale expanded over its block, edge blocks cut to the weight's shape."""
    out_dim, in_dim = quantized.shape
    full = scale.repeat_interleave(BLOCK, dim=0)[:out_dim].repeat_interleave(BLOCK, dim=1)[:, :in_dim]
    return quantized.to(torch.float32) * full


def _published_tensors(float_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's dtypes: FP8 linears with float32 block scales, the routing bias float32, the rest bf16."""
    published: dict[str, torch.Tensor] = {}
    for name, tensor in float_weights.items():
        if FP8_LINEAR.fullmatch(name):
            published[name], published[name.removesuffix(".weight") + ".weight_scale_inv"] = quantize_blocks(tensor)
        elif name.endswith("e_score_correction_bias"):
            published[name] = tensor.float()
        else:
            published[name] = tensor.to(torch.bfloat16)
    return published


def _dequantized(published: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model the FP8 checkpoint holds, in float32."""
    weights = {}
    for name, tensor in published.items():
        if name.endswith(".weight_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = dequantize_reference(tensor, published[name.removesuffix(".weight") + ".weight_scale_inv"])
        weights[name] = tensor.float()
    return weights


def build_checkpoints(config, seed: int, root: Path) -> tuple[Path, Path]:
    """(FP8 checkpoint directory as published, float32 directory of the same model dequantized)."""
    model = random_hf_model(config, seed, off_neutral=True)
    reference, fp8 = root / "dequantized", root / "fp8"
    model.save_pretrained(reference)  # transformers' own names (experts unfused, as published)
    float_weights = {}
    for file in reference.glob("*.safetensors"):
        float_weights.update(load_file(file))
        file.unlink()
    published = _published_tensors(float_weights)

    fp8.mkdir()
    shutil.copy(reference / "generation_config.json", fp8)
    raw = json.loads((reference / "config.json").read_text())
    raw.update(dtype="bfloat16", quantization_config=QUANTIZATION_CONFIG)
    (fp8 / "config.json").write_text(json.dumps(raw, indent=2))
    # two shards split by layer, each weight next to its scale, as the published files keep them
    first = {n: t for n, t in published.items() if not n.startswith("model.layers.1.")}
    save_file(first, fp8 / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({n: t for n, t in published.items() if n not in first}, fp8 / "model-00002-of-00002.safetensors",
              metadata={"format": "pt"})
    save_file(_dequantized(published), reference / "model.safetensors", metadata={"format": "pt"})
    return fp8, reference


# --- reference and runs ---------------------------------------------------------------------------

def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(2, 128, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _kvshard_generation(engine_run, directory: Path, tp: int, dcp: int, prompts: list[list[int]],
                        dtype: str = "float32"):
    result = engine_run(
        directory, prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=LOGPROB_TOP),
        tensor_parallel_size=tp, decode_context_parallel_size=dcp, block_size=KV_BLOCK_SIZE,
        max_model_len=128, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16, dtype=dtype,
    )
    return result.tokens, result.logprobs


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in made:
            made[name] = build_checkpoints(*CONFIGS[name], tmp_path_factory.mktemp(f"fp8-{name}"))
        return made[name]

    return get


@pytest.fixture(scope="module")
def reference(checkpoints, prompts, hf_reference):
    """transformers' greedy tokens and per-step log-probabilities [V] of the dequantized checkpoint."""

    def get(name: str):
        return hf_reference(checkpoints(name)[1], prompts, NEW_TOKENS, logprobs=True)

    return get


# --- tests ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CONFIGS))
def test_checkpoint_has_the_published_layout(checkpoints, name):
    """The premise of the end-to-end tests: FP8 where DeepSeek-V3 has it, blocks across the tp=2 split."""
    fp8, _ = checkpoints(name)
    dtypes, shapes = {}, {}
    for file in fp8.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for n in f.keys():
                tensor = f.get_tensor(n)
                dtypes[n], shapes[n] = tensor.dtype, tuple(tensor.shape)
    quantized = [n for n, d in dtypes.items() if d == torch.float8_e4m3fn]
    assert quantized and all(FP8_LINEAR.fullmatch(n) for n in quantized)
    for n in quantized:
        scale = n.removesuffix(".weight") + ".weight_scale_inv"
        assert dtypes[scale] == torch.float32
        assert shapes[scale] == (math.ceil(shapes[n][0] / BLOCK), math.ceil(shapes[n][1] / BLOCK))
    assert dtypes["model.embed_tokens.weight"] == dtypes["lm_head.weight"] == torch.bfloat16
    assert dtypes["model.norm.weight"] == torch.bfloat16
    # a 128-row block on both sides of the tp=2 split: rows 128..255 of 384
    assert any(shapes[n][0] == 384 for n in quantized if "gate_proj" in n)
    if name == "v3-moe":
        assert dtypes["model.layers.1.mlp.gate.weight"] == torch.bfloat16  # the router stays unquantized
        assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == torch.float32
        assert {"model.layers.1.mlp.experts.0.up_proj.weight", "model.layers.1.mlp.shared_experts.down_proj.weight",
                "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"} <= set(quantized)
    config = EngineArgs(fp8).create_engine_config()
    assert config.model.quantization.block == (BLOCK, BLOCK)
    assert config.model.dtype == torch.bfloat16  # the published dtype, unless --dtype says otherwise


@pytest.mark.parametrize("name, tp, dcp", RUNS, ids=[f"{n}-tp{t}-dcp{d}" for n, t, d in RUNS])
def test_fp8_checkpoint_matches_dequantized_transformers(checkpoints, reference, prompts, engine_run, name, tp, dcp):
    want_tokens, want_logprobs = reference(name)
    tokens, logprobs = _kvshard_generation(engine_run, checkpoints(name)[0], tp, dcp, prompts)
    assert tokens == want_tokens
    worst = 0.0
    for got_steps, want_steps in zip(logprobs, want_logprobs):
        assert len(got_steps) == NEW_TOKENS
        for got_step, want_step in zip(got_steps, want_steps):
            assert set(got_step) == set(want_step.topk(LOGPROB_TOP).indices.tolist())
            worst = max(worst, max(abs(lp - float(want_step[t])) for t, lp in got_step.items()))
    print(f"{name} tp={tp} dcp={dcp}: max |logprob - transformers| = {worst:.2e}")
    assert worst < 1e-3  # the float32 tolerance of the unquantized MLA and Llama tests


def test_published_dtype_runs_in_bfloat16_close_to_float32(checkpoints, reference, prompts, engine_run):
    """The default (`auto`: the checkpoint's bfloat16) at tp=2 dcp=2: weights dequantized to bfloat16.
    Each prompt's first token (from the prefill alone) is one of float32's top five, within 0.15 in
    log-probability, and every request runs to the end."""
    _, want_logprobs = reference("v3-moe")
    tokens, logprobs = _kvshard_generation(engine_run, checkpoints("v3-moe")[0], 2, 2, prompts, dtype="auto")
    for got_tokens, got_steps, want_steps in zip(tokens, logprobs, want_logprobs):
        assert len(got_tokens) == NEW_TOKENS
        first = got_tokens[0]
        assert first in want_steps[0].topk(LOGPROB_TOP).indices.tolist()
        assert got_steps[0][first] == pytest.approx(float(want_steps[0][first]), abs=0.15)


def test_block_dequantization_agrees_with_transformers_on_whole_blocks():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    quantized, scale = quantize_blocks(torch.randn(256, 384))
    theirs = Fp8Dequantize(None)._dequantize_one(quantized, scale, torch.float32)
    assert torch.equal(dequantize_block_fp8(quantized, scale, (BLOCK, BLOCK)), theirs)


def test_partial_edge_blocks_use_their_own_scale():
    torch.manual_seed(0)
    weight = torch.randn(200, 130)  # 2 x 2 blocks, the last row and column of blocks partial
    quantized, scale = quantize_blocks(weight)
    assert scale.shape == (2, 2)
    ours = dequantize_block_fp8(quantized, scale, (BLOCK, BLOCK))
    assert torch.equal(ours, dequantize_reference(quantized, scale))
    assert torch.allclose(ours, weight, rtol=0.07, atol=scale.max().item())  # e4m3 keeps 3 mantissa bits


def _write(directory: Path, tensors: dict[str, torch.Tensor]) -> list[Path]:
    directory.mkdir(exist_ok=True)
    save_file(tensors, directory / "model.safetensors")
    return [directory / "model.safetensors"]


def test_float8_tensor_without_scale_is_named(tmp_path):
    quantized, scale = quantize_blocks(torch.randn(8, 8))
    files = _write(tmp_path, {"a.weight": quantized, "b.weight": quantized.clone(), "a.weight_scale_inv": scale})
    checkpoint = QuantizedCheckpoint(files, Fp8BlockQuantization())
    assert checkpoint.prepare("a.weight", quantized).dtype == torch.float32
    with pytest.raises(ValueError, match=r"'b\.weight' is torch\.float8_e4m3fn without its 'b\.weight_scale_inv'"):
        checkpoint.prepare("b.weight", quantized)
    with pytest.raises(ValueError, match="no quantization_config"):
        QuantizedCheckpoint(files, None)


def test_a_scale_may_sit_in_another_file_than_its_weight(tmp_path):
    quantized, scale = quantize_blocks(torch.randn(300, 8))
    files = _write(tmp_path / "weights", {"a.weight": quantized})
    files += _write(tmp_path / "scales", {"a.weight_scale_inv": scale})
    ours = QuantizedCheckpoint(files, Fp8BlockQuantization()).prepare("a.weight", quantized)
    assert torch.equal(ours, dequantize_reference(quantized, scale))
    with pytest.raises(ValueError, match=r"scales without their weight: \['a\.weight_scale_inv'\]"):
        QuantizedCheckpoint(files[1:], Fp8BlockQuantization())


def test_scales_of_the_wrong_shape_are_named(tmp_path):
    quantized, scale = quantize_blocks(torch.randn(300, 8))
    files = _write(tmp_path, {"a.weight": quantized, "a.weight_scale_inv": scale[:2]})
    with pytest.raises(ValueError, match=r"'a\.weight' of shape \(300, 8\) has scales of shape \(2, 1\).*\(3, 1\)"):
        QuantizedCheckpoint(files, Fp8BlockQuantization()).prepare("a.weight", quantized)


def _with_quantization(tmp_path: Path, quantization_config: dict) -> Path:
    from transformers import AutoModelForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, architectures=["LlamaForCausalLM"])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", "compressed-tensors"])
def test_unsupported_quantization_is_refused_before_any_rank_starts(tmp_path, method):
    directory = _with_quantization(tmp_path, {"quant_method": method, "bits": 4})
    with pytest.raises(ConfigError) as error:
        LLM(str(directory))
    message = str(error.value)
    assert f"quantization method {method!r} is not supported" in message and "fp8" in message
    assert "\n" not in message


@pytest.mark.parametrize("change, words", [
    ({"weight_block_size": None}, "one scale per tensor"),
    ({"activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"fmt": "e5m2"}, "format 'e5m2'"),
    ({"weight_block_size": [128]}, "two positive integers"),
])
def test_fp8_variants_kvshard_cannot_read_are_refused(tmp_path, change, words):
    quantization = {k: v for k, v in {**QUANTIZATION_CONFIG, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=re.escape(words)):
        EngineArgs(_with_quantization(tmp_path, quantization)).create_engine_config()
