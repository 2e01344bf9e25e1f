"""The attention backends (kvshard/attention/backends.py): chosen once at start-up, and exact.

The exactness suites run the default backend (`auto`: the paged kernel where it builds). Here:
how the backend is chosen and reported; a step whose short chunks after cached context the paged
kernel reads row by row, against the same step as chunk attention + merge (gather) and against the
reference; and one representative engine of each exactness suite with `--attention-backend gather`
(GQA with several KV heads in the replicated DCP layout, chunked prefill, prefix hits and n-gram
speculation in one engine; MLA under DCP; an FP8 cache), against transformers or the paged backend.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil

import pytest
import torch
from transformers import DeepseekV3Config

from kvshard import LLM, SamplingParams
from kvshard.attention import backends, paged
from kvshard.attention.backend import Attention
from kvshard.attention.metadata import AttentionMetadata
from kvshard.engine.arg_utils import EngineArgs
from kvshard.errors import ConfigError
from kvshard.kv.cache import KVCacheSpec, allocate_kv_cache
from kvshard.kv.layout import DCPLayout
from kvshard.parallel import single_rank_state
from conftest import assert_same_generation, hf_greedy_with_logprobs, save_hf_checkpoint, tiny_llama_config

HAS_COMPILER = shutil.which("c++") is not None
needs_kernel = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler found to build the paged kernel")


# --- choosing the backend ------------------------------------------------------------------------

@needs_kernel
def test_auto_is_the_paged_kernel_and_the_report_names_the_backend(checkpoints, monkeypatch):
    monkeypatch.setattr(backends, "cpu_capability", lambda: "AVX512")  # the kernel's width (also on AVX2)
    path = str(checkpoints("backends-llama", tiny_llama_config()))
    assert backends.resolve_backend_name("auto", "cpu") == "paged"
    config = EngineArgs(model=path).create_engine_config()
    assert config.attention_backend == "paged"
    assert "attention backend: paged" in config.layout_report()
    path_name = "AVX-512 tiles" if paged.load_extension().tiled else "portable loops"  # the build's path, named
    if paged.load_extension().tiled and paged.amx_ready():
        path_name += "; AMX tiles for bfloat16 keys of head size 32 to 128"
    assert f"reading the paged KV cache in place: {path_name})" in config.layout_report()
    gather = EngineArgs(model=path, attention_backend="gather").create_engine_config()
    assert gather.attention_backend == "gather" and "attention backend: gather" in gather.layout_report()
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([path, "--attention-backend", "reference"])).attention_backend \
        == "reference"
    with pytest.raises(SystemExit):
        parser.parse_args([path, "--attention-backend", "flash"])
    with pytest.raises(ConfigError, match="attention_backend='flash' is not one of auto, paged, gather, reference"):
        EngineArgs(model=path, attention_backend="flash").create_engine_config()


@needs_kernel
def test_auto_gathers_on_a_cpu_without_avx512_and_paged_still_runs_when_asked(checkpoints, monkeypatch, caplog):
    monkeypatch.setattr(backends, "cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(backends, "_logged", set())  # said once per process: an earlier engine may have said it
    path = str(checkpoints("backends-llama", tiny_llama_config()))
    with caplog.at_level(logging.INFO, logger="kvshard.attention.backends"):
        assert backends.resolve_backend_name("auto", "cpu") == "gather"
    assert any("gather, not the paged kernel" in r.getMessage() and "AVX2" in r.getMessage() for r in caplog.records)
    config = EngineArgs(model=path).create_engine_config()
    assert config.attention_backend == "gather"
    assert "auto takes it on a CPU without AVX-512 (AVX2)" in config.layout_report()
    assert EngineArgs(model=path, attention_backend="paged").create_engine_config().attention_backend == "paged"


def test_without_the_kernel_auto_says_why_and_gathers_and_paged_is_refused(monkeypatch, caplog):
    monkeypatch.setattr(paged, "_module", None)
    monkeypatch.setattr(paged, "_unavailable", None)
    monkeypatch.setattr(backends, "cpu_capability", lambda: "AVX512")  # a CPU whose auto would be the kernel
    monkeypatch.setenv("CXX", "kvshard-no-such-compiler")
    with caplog.at_level("WARNING", logger="kvshard.attention.paged"):
        assert backends.resolve_backend_name("auto", "cpu") == "gather"
        assert backends.resolve_backend_name("auto", "cpu") == "gather"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no C++ compiler (kvshard-no-such-compiler)" in lines[0], lines
    assert "the paged kernel is unavailable: no C++ compiler" in backends.describe_backend("gather")
    with pytest.raises(ConfigError, match="attention_backend='paged'.*no C\\+\\+ compiler.*use --attention-backend"):
        backends.resolve_backend_name("paged", "cpu")
    # the C++ kernel is for CPUs: on CUDA, auto is the Triton backend where triton can run, else gather
    from kvshard.attention import triton_paged
    assert backends.resolve_backend_name("auto", "cuda") == ("triton" if triton_paged.available() is None else "gather")


# --- one step, three backends ---------------------------------------------------------------------

BLOCK = 4
# scheduler order: two decodes, a 3-row chunk after 9 cached tokens (verification rows: read in the
# cache row by row by paged/reference), a 20-row chunk after 6 (chunk attention + merge for all), a first chunk
CONTEXT_LENS, QUERY_LENS = [5, 13, 9, 6, 0], [1, 1, 3, 20, 4]
TABLES = [[2, 9], [1, 5, 6, 11], [3, 12, 0], [4, 8, 10, 13, 14, 15, 16], [7, 17]]


def _step(backend_name: str, cache, q, k, v, attention):
    meta = AttentionMetadata.build(CONTEXT_LENS, QUERY_LENS, TABLES, DCPLayout(BLOCK, 1, 1), 0, torch.device("cpu"),
                                   backend=backends.make_backend(backend_name))
    return meta, attention.forward(q, k, v, cache, meta)


@needs_kernel
@pytest.mark.parametrize("flash_chunks", ["0", "1"])
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_rows_read_in_the_cache_give_what_chunk_attention_and_the_merge_give(kind, flash_chunks, monkeypatch):
    """With KVSHARD_FLASH_CHUNKS=1 the paged backend runs the 20-row chunk's attention to itself and to its
    cached context in PyTorch's flash kernel (as on a CPU with AMX tiles in bfloat16), the rest in its kernel."""
    monkeypatch.setenv("KVSHARD_FLASH_CHUNKS", flash_chunks)
    g = torch.Generator().manual_seed(3)
    state = single_rank_state()
    t = sum(QUERY_LENS)
    if kind == "mla":  # one latent of 24 channels, V its first 16
        spec, heads, kv_heads = KVCacheSpec(1, 1, key_dim=24, value_dim=16, value_in_key=True), 4, 1
    else:
        spec, heads, kv_heads = KVCacheSpec(1, 2, key_dim=16, value_dim=16, value_in_key=False), 6, 2
    q = torch.randn(t, heads, spec.key_dim, generator=g)
    k = torch.randn(t, kv_heads, spec.key_dim, generator=g)
    v = k[..., : spec.value_dim] if kind == "mla" else torch.randn(t, kv_heads, spec.value_dim, generator=g)
    attention = Attention(state.attention_heads(heads, kv_heads), 1 / math.sqrt(spec.key_dim), state)
    gathered = []  # the rows each group's gathered context was attended for
    original = backends._gathered_context
    monkeypatch.setattr(backends, "_gathered_context",
                        lambda q, *args: gathered.append(q.shape[0]) or original(q, *args))
    results = {}
    for name in ("reference", "gather", "paged"):
        (cache,) = allocate_kv_cache(spec, 18, BLOCK, torch.float32, torch.device("cpu"))
        torch.manual_seed(0)
        cache.key.normal_()  # the cached context, the same for every backend
        if not cache.value_is_view:
            cache.value.normal_()
        gathered.clear()
        meta, results[name] = _step(name, cache, q, k, v, attention)
        in_cache = [group.rows_in_cache for group in meta.groups]
        assert in_cache == ([False, True, False, False] if name != "gather" else [False] * 4), (name, in_cache)
        if name == "paged":  # the 20-row chunk's context in the flash kernel, the rest in the paged kernel
            assert gathered == ([20] if flash_chunks == "1" else []), gathered
    torch.testing.assert_close(results["paged"], results["reference"], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(results["gather"], results["reference"], atol=2e-5, rtol=2e-5)


@needs_kernel
def test_verification_rows_read_in_the_cache_are_the_decodes_of_their_tokens_bit_for_bit():
    """Row j of a short chunk after cached context sees the tokens up to its own position: what a
    decode of that token computes, to the bit, so that speculation changes no logprob."""
    g = torch.Generator().manual_seed(4)
    spec = KVCacheSpec(1, 1, key_dim=16, value_dim=16, value_in_key=False)
    (cache,) = allocate_kv_cache(spec, 8, BLOCK, torch.bfloat16, torch.device("cpu"))
    cache.key.copy_(torch.randn(cache.key.shape, generator=g))
    cache.value.copy_(torch.randn(cache.value.shape, generator=g))
    q = torch.randn(3, 4, 16, generator=g).to(torch.bfloat16)
    layout, cpu, paged_backend = DCPLayout(BLOCK, 1, 1), torch.device("cpu"), backends.make_backend("paged")
    chunk = AttentionMetadata.build([9], [3], [[3, 1, 6]], layout, 0, cpu, backend=paged_backend)
    assert chunk.row_lens.tolist() == [10, 11, 12] and not chunk.has_prefill
    decodes = AttentionMetadata.build([9, 10, 11], [1, 1, 1], [[3, 1, 6]] * 3, layout, 0, cpu, backend=paged_backend)
    for a, b in zip(paged_backend.attend_context(q, cache, chunk, 0.25), paged_backend.attend_context(q, cache, decodes, 0.25)):
        assert torch.equal(a, b)


def test_long_chunks_take_the_flash_kernel_in_bfloat16_where_the_cpu_has_amx_tiles(monkeypatch):
    monkeypatch.delenv("KVSHARD_FLASH_CHUNKS", raising=False)
    for amx in (True, False):
        monkeypatch.setattr(backends, "amx_tiles", lambda amx=amx: amx)
        assert backends.flash_for_chunks(torch.bfloat16) is amx
        assert not backends.flash_for_chunks(torch.float32) and not backends.flash_for_chunks(torch.float16)
        if paged.kernel_available():  # the start-up report says where the long chunks go
            line = backends.describe_backend("paged", torch.bfloat16)
            assert ("prefill chunks of more than 16 rows" in line) is amx, line
            if amx:  # the kernel's own AMX path where its build has it, else flash's tile products
                assert ("the kernel's AMX path" in line) is paged.amx_ready(), line
                assert ("in PyTorch's flash kernel (its AMX tile products" in line) is not paged.amx_ready(), line
            assert "flash" not in backends.describe_backend("paged", torch.float32)
    for forced, want in (("1", True), ("0", False)):
        monkeypatch.setenv("KVSHARD_FLASH_CHUNKS", forced)
        assert all(backends.flash_for_chunks(dtype) is want for dtype in (torch.bfloat16, torch.float32))


# --- representative engines with --attention-backend gather -------------------------------------

NEW_TOKENS = 12
PROMPTS = [[3, 1, 4], [(7 * i) % 97 + 1 for i in range(21)], [(5 * i) % 89 + 2 for i in range(13)]]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MLA_CONFIG = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=8, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    max_position_embeddings=256, bos_token_id=0, eos_token_id=1, initializer_range=0.3, q_lora_rank=None,
    first_k_dense_replace=2, rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def _transformers(path, prompts):
    """transformers' greedy tokens, and each step's log-probabilities as {token: logprob} over the vocabulary."""
    tokens, steps = hf_greedy_with_logprobs(path, prompts, NEW_TOKENS)
    return tokens, [[dict(enumerate(step.tolist())) for step in prompt_steps] for prompt_steps in steps]


def _generate(llm, prompts):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def test_gather_gqa_replicated_dcp_chunked_prefix_hits_and_speculation_match_transformers(checkpoints):
    # SmolLM2's heads (9 query over 3 KV): only the replicated layout runs them at tp=2 dcp=2
    path = checkpoints("backends-9q3kv", tiny_llama_config(num_attention_heads=9, num_key_value_heads=3, head_dim=8,
                                                           hidden_size=72, intermediate_size=144))
    want_tokens, want_logprobs = _transformers(path, PROMPTS)
    with LLM(str(path), attention_backend="gather", tensor_parallel_size=2, decode_context_parallel_size=2,
             dcp_kv_interleave_size=BLOCK, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=12,
             kv_cache_memory="256KiB", max_model_len=64, speculative_config=NGRAM) as llm:
        assert llm.config.attention_backend == "gather" and llm.config.parallel.attention_layout == "replicated"
        first = _generate(llm, PROMPTS)
        again = _generate(llm, PROMPTS)  # the prompts' blocks are cached now: the rest is a chunk after them
        stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.spec_decode_num_draft_tokens > 0
    for tokens, logprobs in (first, again):
        assert_same_generation(tokens, logprobs, want_tokens, want_logprobs, atol=1e-4, same_candidates=False)


def test_gather_mla_under_dcp_matches_transformers(tmp_path):
    path = save_hf_checkpoint(DeepseekV3Config(**MLA_CONFIG), tmp_path / "mla", seed=4, off_neutral=True)  # no near-tie
    want_tokens, want_logprobs = _transformers(path, PROMPTS)
    with LLM(str(path), attention_backend="gather", tensor_parallel_size=2, decode_context_parallel_size=2,
             block_size=BLOCK, max_model_len=64, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=12) as llm:
        got = _generate(llm, PROMPTS)
    assert_same_generation(*got, want_tokens, want_logprobs, atol=1e-3, same_candidates=False)


# prompts of 37-45 tokens in chunks of 24 rows: every prompt's second chunk (13-21 rows after 24 cached
# tokens) and, on the second pass, the 24 new tokens after each prompt's cached blocks are long chunks
# after cached context
LONG_PROMPTS = [[(17 * i + 5 * p) % 97 + 2 for i in range(37 + 4 * p)] for p in range(3)]
LONG_AGAIN = [prompt + [(13 * i + p) % 89 + 3 for i in range(24)] for p, prompt in enumerate(LONG_PROMPTS)]


@needs_kernel
@pytest.mark.parametrize("kind", ["gqa", "mla-absorbed", "mla-expanded"])
def test_long_chunks_in_the_flash_kernel_match_transformers(kind, checkpoints, tmp_path, monkeypatch):
    """The paged backend with a long chunk's attention in PyTorch's flash kernel (KVSHARD_FLASH_CHUNKS=1, the
    default for bfloat16 on a CPU with AMX tiles) at tp=2 dcp=2, chunked prefill and prefix hits: transformers'
    tokens and logprobs. MLA reads a long chunk's cached context in the absorbed form, or in the expanded form
    with KVSHARD_MLA_EXPANDED_MIN_ROWS=8."""
    monkeypatch.setenv("KVSHARD_FLASH_CHUNKS", "1")
    if kind == "gqa":
        path = checkpoints("backends-9q3kv", tiny_llama_config(num_attention_heads=9, num_key_value_heads=3,
                                                               head_dim=8, hidden_size=72, intermediate_size=144))
    else:
        path = save_hf_checkpoint(DeepseekV3Config(**MLA_CONFIG), tmp_path / "mla", seed=4, off_neutral=True)
        if kind == "mla-expanded":
            monkeypatch.setenv("KVSHARD_MLA_EXPANDED_MIN_ROWS", "8")
    engine = dict(attention_backend="paged", dtype="float32", tensor_parallel_size=2, decode_context_parallel_size=2,
                  block_size=BLOCK, max_model_len=96, num_kv_blocks=96, max_num_seqs=4, max_num_batched_tokens=24)
    with LLM(str(path), **engine) as llm:
        first = _generate(llm, LONG_PROMPTS)
        again = _generate(llm, LONG_AGAIN)
        assert llm.engine.stats().prefix_cache_hits > 0
    for prompts, got in ((LONG_PROMPTS, first), (LONG_AGAIN, again)):
        assert_same_generation(*got, *_transformers(path, prompts), atol=1e-3 if kind != "gqa" else 1e-4,
                               same_candidates=False)


@needs_kernel
def test_fp8_cache_gather_and_paged_agree(checkpoints):
    path = str(checkpoints("backends-llama", tiny_llama_config()))
    # float32 compute (in bfloat16 the gather path rounds P and the dequantized values to bfloat16 where the
    # kernel keeps float32, which can flip a near-tie of a tiny model). A short chunk after cached context the
    # paged and reference backends read from the e4m3 cache (each row to its own position) where the gather
    # path attends it to its own unquantized K/V: paged must equal the reference in logprobs, and the gather
    # path (other rounding of those rows, compounding over the steps) give the same tokens
    engine = dict(dtype="float32", kv_cache_dtype="fp8", block_size=BLOCK, max_model_len=64, num_kv_blocks=64,
                  max_num_seqs=4, max_num_batched_tokens=12)
    runs = {}
    for name in ("gather", "paged", "reference"):
        with LLM(path, attention_backend=name, **engine) as llm:
            runs[name] = _generate(llm, PROMPTS)
    assert_same_generation(*runs["paged"], *runs["reference"], atol=1e-4)
    assert runs["gather"][0] == runs["paged"][0]


def test_a_build_killed_midway_does_not_hang_the_next_start(tmp_path):
    # torch's build lock is a file; a build killed while holding it leaves it behind, and torch's next
    # load would wait on it forever. kvshard's own lock (dropped by the system when its holder dies)
    # shows no builder is alive, and the stale file goes before torch looks.
    import multiprocessing
    import time

    from kvshard.attention import paged

    build = tmp_path / "kvshard_paged_attention_x"
    build.mkdir()
    (build / "lock").touch()
    with paged._builder_lock(build):
        assert not (build / "lock").exists()
    # while a live builder holds kvshard's lock, a second one waits for it (and then goes on)
    ctx = multiprocessing.get_context("spawn")
    held = ctx.Event()
    holder = ctx.Process(target=_hold_builder_lock, args=(str(build), held, 1.5))
    holder.start()
    assert held.wait(60)
    start = time.monotonic()
    with paged._builder_lock(build):
        waited = time.monotonic() - start
    holder.join(30)
    assert waited > 0.5, waited


def _hold_builder_lock(build: str, held, seconds: float) -> None:
    import time
    from pathlib import Path

    from kvshard.attention import paged

    with paged._builder_lock(Path(build)):
        held.set()
        time.sleep(seconds)


@pytest.mark.parametrize("inference", [False, True])
def test_packed_of_takes_the_kernels_packed_output_as_it_is(inference):
    # the kernel's o and lse are views of one [t, H, dv + 1]: packed_of hands that tensor on without a copy, also under
    # torch.inference_mode (the engine's steps), where a view records no base; anything else is concatenated
    with torch.inference_mode(inference):
        packed = torch.randn(5, 3, 9)
        out, lse = packed[..., :-1], packed[..., -1]
        whole = paged.packed_of(out, lse)
        assert whole.data_ptr() == packed.data_ptr() and whole.shape == (5, 3, 9) and torch.equal(whole, packed)
        rows = packed[1:4]  # a run of rows of it: still one tensor
        assert paged.packed_of(rows[..., :-1], rows[..., -1]).data_ptr() == rows.data_ptr()
        empty_out, empty_lse = paged.empty_packed(4, 2, 6, torch.device("cpu"))
        assert paged.packed_of(empty_out, empty_lse).data_ptr() == empty_out.data_ptr()
        cases = [
            (out.clone(), lse.clone()),  # apart
            (out, packed[..., 0]),  # lse not the channel after o
            (packed[:, :, 1:], packed[..., 0]),  # o not first
            (packed[::2, :, :-1], packed[::2, :, -1]),  # every second row: strided
            (torch.randn(4, 2, 8)[..., :7], torch.randn(4, 2))
        ]
        for o, l in cases:
            glued = paged.packed_of(o, l)
            assert glued.shape == (o.shape[0], o.shape[1], o.shape[2] + 1)
            assert torch.equal(glued[..., :-1], o) and torch.equal(glued[..., -1], l)
            assert glued.untyped_storage().data_ptr() != o.untyped_storage().data_ptr()  # a copy
