"""`--kv-cache-dtype fp8`: the cache stores float8 e4m3, attention reads it back in the model's dtype.

Bytes are exact (half of bfloat16, a quarter of float32, at every dcp; capacity and
concurrency follow). Quality is measured against the bfloat16 cache on the same model
by `fp8_agreement` below, which docs/serving.md ("FP8 KV cache") reports.
"""

from __future__ import annotations

import argparse
import json
import pytest
import torch
from safetensors.torch import save_file

from kvshard import LLM, SamplingParams
from kvshard.engine.arg_utils import EngineArgs
from kvshard.errors import ConfigError
from kvshard.kv.cache import FP8_MAX, GatherBuffers, KVScales, allocate_kv_cache, kv_cache_spec, load_kv_scales
from kvshard.planner.arch import dtype_bytes, parse_hf_config
from kvshard.planner.layout import HEAD_SPLIT, AttentionLayout
from kvshard.planner.memory import kv_slot_bytes

GQA, MLA = "kvshard-demo-gqa", "kvshard-demo"
BLOCK = 4

QUALITY_PROMPTS = [
    "Decode context parallelism shards the key value cache",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Long prompts, short answers: an agent reads a large context",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10",
    "The scheduler admits requests while free blocks remain",
    "Hello, world! Each rank of a group keeps one token in N",
    "One decode step gathers the queries, attends to the local shard",
]


def engine_config(model: str, kv_cache_dtype: str, tp: int = 1, dcp: int = 1, dtype: str = "bfloat16"):
    return EngineArgs(model=model, kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tp,
                      decode_context_parallel_size=dcp, dtype=dtype, kv_cache_memory="4MiB",
                      max_model_len=256).create_engine_config()


# --- bytes, capacity, concurrency ---------------------------------------------------------------

@pytest.mark.parametrize("model", [GQA, MLA])
@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 1), (2, 2), (4, 4)])
def test_fp8_halves_bf16_and_quarters_fp32_bytes_at_every_dcp(model, tp, dcp):
    fp8, bf16, fp32 = (engine_config(model, kv, tp, dcp, dtype) for kv, dtype in
                       (("fp8", "bfloat16"), ("auto", "bfloat16"), ("auto", "float32")))
    assert fp8.kv_cache_dtype == torch.float8_e4m3fn and bf16.kv_cache_dtype == torch.bfloat16
    assert fp8.kv_bytes_per_slot == fp8.kv_cache_spec.num_layers * fp8.kv_cache_spec.values_per_slot_per_layer
    assert 2 * fp8.kv_bytes_per_token_per_rank == bf16.kv_bytes_per_token_per_rank
    assert 4 * fp8.kv_bytes_per_token_per_rank == fp32.kv_bytes_per_token_per_rank
    # the same budget holds twice the blocks (up to the one block the division rounds away)
    assert fp8.num_kv_blocks == 4 * 2**20 // (BLOCK * 4 * fp8.kv_bytes_per_slot)
    assert 2 * bf16.num_kv_blocks <= fp8.num_kv_blocks <= 2 * bf16.num_kv_blocks + 1
    assert fp8.kv_capacity_tokens == fp8.num_kv_blocks * BLOCK * 4 * dcp
    assert fp8.max_concurrency / bf16.max_concurrency == pytest.approx(2, rel=1 / bf16.num_kv_blocks)
    assert "KV cache dtype: float8_e4m3fn" in fp8.layout_report()


def test_fp8_e4m3_is_fp8_and_unknown_dtypes_fail_early():
    assert engine_config(GQA, "fp8_e4m3").kv_bytes_per_slot == engine_config(GQA, "fp8").kv_bytes_per_slot
    with pytest.raises(ConfigError, match="kv_cache_dtype='int4'.*auto, fp8, fp8_e4m3"):
        engine_config(GQA, "int4")


def test_flag_reaches_a_child_serve():
    """`bench dcp` hands its engine settings to each server through to_cli_args."""
    args = EngineArgs(kv_cache_dtype="fp8")
    assert args.to_cli_args() == ["--kv-cache-dtype", "fp8"]
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "fp8"])).kv_cache_dtype == "fp8"


@pytest.mark.parametrize("model", [GQA, MLA])
def test_engine_allocates_one_byte_per_cached_value(model):
    with LLM(model, kv_cache_dtype="fp8", dtype="bfloat16", kv_cache_memory="4MiB", max_model_len=256,
             block_size=BLOCK) as llm:
        runner, config = llm.engine.runner, llm.config
        assert all(layer.key.dtype == torch.float8_e4m3fn for layer in runner.kv_caches)
        assert runner.kv_cache_bytes == config.num_kv_blocks * BLOCK * config.kv_bytes_per_slot
        assert runner.kv_cache_bytes <= 4 * 2**20 < runner.kv_cache_bytes + BLOCK * config.kv_bytes_per_slot
        out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=8, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 8


# --- quantize on write, dequantize after gather -----------------------------------------------------

@pytest.mark.parametrize("model", [GQA, MLA])
@pytest.mark.parametrize("scales", [KVScales(), KVScales(0.5, 4.0)])
def test_write_then_gather_is_e4m3_rounding_of_the_scaled_values(model, scales):
    config = engine_config(model, "fp8")
    spec = kv_cache_spec(config.model, 1)
    layer = allocate_kv_cache(spec, 6, BLOCK, torch.bfloat16, torch.device("cpu"), torch.float8_e4m3fn,
                              [scales] * spec.num_layers)[0]
    torch.manual_seed(0)
    slots = torch.tensor([0, 5, 9, 14, 23])
    key = torch.randn(len(slots), spec.num_kv_heads, spec.key_dim, dtype=torch.bfloat16) * 3
    key[0, 0, :3] = torch.tensor([1e4, -1e4, 447.0])  # beyond e4m3's range: saturates, never NaN
    value = torch.randn(len(slots), spec.num_kv_heads, spec.value_dim, dtype=torch.bfloat16)
    layer.write(slots, key, value)
    buffers = GatherBuffers()
    keys, values = layer.gather(torch.tensor([[0, 2, 3, 5]]), buffers)  # [1, 16, Hk, dk]
    assert keys.dtype == values.dtype == torch.bfloat16  # what the fused CPU kernel expects
    # blocks 0, 2, 3, 5 hold slots 0, 9, 14, 23 at gathered rows 0, 4+1, 8+2, 12+3 (slot 5's block 1 is left out)
    rows_in_gather, written = torch.tensor([0, 5, 10, 15]), torch.tensor([0, 2, 3, 4])
    want_key = (key.float() / scales.key).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.bfloat16)
    assert not keys.isnan().any()
    assert torch.equal(keys[0, rows_in_gather], want_key[written] * scales.key)
    assert keys[0, 0, 0, 0] == FP8_MAX * scales.key and keys[0, 0, 0, 1] == -FP8_MAX * scales.key
    if spec.value_in_key:  # MLA: the value is the latent's leading channels, dequantized with it
        assert values.data_ptr() == keys.data_ptr() and values.shape[-1] == spec.value_dim
    else:
        want_value = (value.float() / scales.value).to(torch.float8_e4m3fn).to(torch.bfloat16) * scales.value
        assert torch.equal(values[0, rows_in_gather], want_value[written])
    assert keys.data_ptr() == buffers.key.data_ptr()  # the step's buffers hold the dequantized blocks


def test_kv_scales_are_read_from_the_checkpoint(tmp_path):
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.25), "model.layers.0.self_attn.v_scale":
               torch.tensor([2.0]), "model.layers.2.self_attn.kv_scale": torch.tensor(3.0),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    assert load_kv_scales(tmp_path, 3) == [KVScales(0.25, 2.0), KVScales(1.0, 1.0), KVScales(3.0, 3.0)]
    save_file({"model.layers.0.self_attn.k_scale": torch.ones(4)}, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match="one scale per tensor"):
        load_kv_scales(tmp_path, 3)


# --- quality against the bfloat16 cache ----------------------------------------------------------

def teacher_forced(llm: LLM, sequences: list[list[int]]) -> list[list[dict[int, float]]]:
    """The top-20 log-probabilities of each position of each sequence given the tokens before it.

    The sequences grow one token per call, all in one step: with one-token blocks the prefix
    cache holds everything before the new token, so that token attends to the others read
    back from the cache, as a decode step does (at dcp=N a cache hit covers whole virtual
    blocks of N tokens, so up to N-1 preceding tokens are computed in the same step, and read
    rounded as the cache holds them: `KVCacheLayer.as_read`).
    """
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=20)
    scored: list[list[dict[int, float]]] = [[] for _ in sequences]
    for length in range(1, max(map(len, sequences))):
        growing = [i for i, seq in enumerate(sequences) if len(seq) > length]
        outs = llm.generate([sequences[i][:length] for i in growing], params, use_tqdm=False)
        for i, out in zip(growing, outs):
            scored[i].append(out.outputs[0].logprobs[0])  # the distribution of sequences[i][length]
    return scored


def fp8_agreement(model: str, prompts: list[str] = QUALITY_PROMPTS, new_tokens: int = 32, **engine) -> dict:
    """The FP8 cache against the bfloat16 cache, teacher-forced on the bfloat16 cache's greedy text.

    The bfloat16 engine writes a greedy continuation of each prompt (`new_tokens` tokens); both
    engines then score every continuation position given the same preceding tokens.
    `top1_agreement`: the fraction of positions whose most likely token is the same;
    `mean_abs_logprob_diff`: the mean |difference| of the log-probability of the bfloat16 cache's
    top-1 token (positions where the FP8 top 20 lacks it are counted in `missing`).
    """
    engine = dict(dtype="bfloat16", max_model_len=256, kv_cache_memory="16MiB", block_size=1,
                  max_num_seqs=len(prompts), max_num_batched_tokens=2 * len(prompts), **engine)
    with LLM(model, **engine) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
        reference = teacher_forced(llm, sequences)
    with LLM(model, kv_cache_dtype="fp8", **engine) as llm:
        scored = teacher_forced(llm, sequences)
    agree, diffs, missing, reproduced = 0, [], 0, 0
    for seq, ref_steps, fp8_steps in zip(sequences, reference, scored):
        for token, ref, fp8 in list(zip(seq[1:], ref_steps, fp8_steps))[-new_tokens:]:  # the continuation
            top = max(ref, key=ref.get)
            reproduced += top == token
            agree += top == max(fp8, key=fp8.get)
            if top in fp8:
                diffs.append(abs(ref[top] - fp8[top]))
            else:
                missing += 1
    positions = len(sequences) * new_tokens
    return {"positions": positions, "top1_agreement": agree / positions,
            "mean_abs_logprob_diff": sum(diffs) / len(diffs), "max_abs_logprob_diff": max(diffs),
            "missing": missing, "bf16_scoring_reproduces_its_greedy": reproduced / positions}


@pytest.mark.parametrize("model,tp,dcp", [(GQA, 1, 1), (GQA, 2, 2), (MLA, 1, 1), (MLA, 2, 2)])
def test_fp8_cache_quality_against_bf16_cache(model, tp, dcp):
    result = fp8_agreement(model, tensor_parallel_size=tp, decode_context_parallel_size=dcp)
    print(model, tp, dcp, result)
    # bounds from docs/serving.md's measurement, with margin
    assert result["top1_agreement"] >= 0.75
    assert result["mean_abs_logprob_diff"] <= 0.1


@pytest.mark.parametrize("model", [GQA, MLA])
@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_planner_counts_the_engines_fp8_bytes(model, tp, dcp):
    """`kvshard plan --kv-dtype fp8` and `--kv-cache-dtype fp8` agree on what a cached token costs."""
    config = engine_config(model, "fp8", tp, dcp)
    arch = parse_hf_config(json.loads((config.model.path / "config.json").read_text()), model)
    layout = AttentionLayout(tp, dcp, HEAD_SPLIT)
    assert kv_slot_bytes(arch, layout, dtype_bytes("fp8")) == config.kv_bytes_per_slot


def test_engine_reads_the_checkpoints_kv_scales(tmp_path):
    """Scales next to the weights (vLLM's names) reach every layer's cache; the loader skips them."""
    source = engine_config(GQA, "fp8").model.path
    for file in source.iterdir():
        (tmp_path / file.name).symlink_to(file)
    layers = engine_config(GQA, "fp8").model.num_layers
    save_file({f"model.layers.{i}.self_attn.{name}": torch.tensor(value) for i in range(layers)
               for name, value in (("k_scale", 2.0), ("v_scale", 0.5))}, tmp_path / "kv_scales.safetensors")
    with LLM(str(tmp_path), kv_cache_dtype="fp8", dtype="bfloat16", kv_cache_memory="4MiB", max_model_len=256) as llm:
        assert [layer.scales for layer in llm.engine.runner.kv_caches] == [KVScales(2.0, 0.5)] * layers
        assert len(llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids) == 4



def _scores(model: str, prompts: list[str], **engine) -> list[list[dict[int, float]]]:
    """Each prompt's top-5 logprobs at its positions (prompt logprobs, which are always computed: the engine
    recomputes what a prefix hit would skip) or, with prefix caching, at its first output token, sampled again
    once its blocks are cached."""
    cached = engine.get("enable_prefix_caching", False)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5, prompt_logprobs=None if cached else 5)
    with LLM(model, dtype="float32", kv_cache_dtype="fp8", max_model_len=256, kv_cache_memory="8MiB",
             block_size=4, max_num_seqs=4, **engine) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        if cached:
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert all(o.num_cached_tokens for o in outs)
    return [(o.prompt_logprobs or [None])[1:] + [o.outputs[0].logprobs[0]] for o in outs]


@pytest.mark.parametrize("model", [GQA, MLA])
def test_a_prompt_sees_its_context_as_stored_however_it_was_computed(model):
    """With an FP8 cache a token attends to every earlier token as the cache holds it, rounded, also to the tokens
    of its own prefill chunk: so a prompt's logprobs (float32 model, where nothing else differs by more than
    1e-5) are the same computed whole, in chunks of 8 tokens, or after a prefix-cache hit. Attending to the
    chunk's own tokens unrounded moved them by up to some 1e-2."""
    prompts = QUALITY_PROMPTS[:4]
    whole = _scores(model, prompts, max_num_batched_tokens=256, enable_prefix_caching=False)
    for split in (dict(max_num_batched_tokens=8, enable_prefix_caching=False),
                  dict(max_num_batched_tokens=256, enable_prefix_caching=True)):
        other = _scores(model, prompts, **split)
        pairs = [(a, b) for pa, pb in zip(whole, other) for a, b in zip(pa[::-1], pb[::-1])]  # from the last
        assert all(a.keys() == b.keys() for a, b in pairs), split
        worst = max(abs(a[t] - b[t]) for a, b in pairs for t in a)
        assert worst < 1e-4, (split, worst)
