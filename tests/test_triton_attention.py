"""The Triton paged attention kernels (kvshard/attention/triton_paged.py) against the reference,
on the CPU under Triton's interpreter: the indexing through the block table, the masks, the split
of the sequence and its merge by LSE, GQA head groups and MLA's latent, FP8 caches with scales,
and the rows a DCP rank holds none of (lse -inf). The same kernels are what a GPU compiles.

Shapes are small: the interpreter runs every program in numpy. The cache, the block tables and
the oracle are those of the C++ kernel's tests. At the end, the whole model through the Triton
backend (tiny Llama with GQA, tiny MLA; tp=1 and dcp=2) against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from kvshard.attention import triton_paged
from kvshard.kv.cache import FP8_DTYPE
from kvshard.kv.layout import DCPLayout
from test_paged_attention import _check, _run as _paged_case, step_cache

# tests/conftest.py turns the interpreter on where no GPU is found; CI installs triton
pytestmark = pytest.mark.skipif(not triton_paged.interpreted(),
                                reason=triton_paged.available() or "Triton's interpreter is off (TRITON_INTERPRET)")


def _run(*, num_splits=0, block_n=16, **case):
    """test_paged_attention's case (random cache, shuffled tables, a DCP rank's rows, the oracle) through the
    Triton kernel."""
    return _paged_case(kernel=triton_paged.triton_paged_attention, num_splits=num_splits, block_n=block_n, **case)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("interleave,dcp,rank", [(1, 1, 0), (1, 2, 1), (16, 2, 1)])
def test_decode_rows_gqa(block_size, interleave, dcp, rank):
    # 9 query heads on 3 KV heads (SmolLM2's grouping): a head tile of 16 with 13 masked heads
    lens = _run(heads=9, kv_heads=3, dk=32, dv=32, block_size=block_size, interleave=interleave, dcp=dcp,
                rank=rank, context_lens=[1, 5, 37, 90], query_lens=[1] * 4)
    if dcp > 1:
        assert int(lens.min()) == 0  # a request this rank holds none of: lse -inf, checked


def test_several_rows_per_request_each_with_its_bound():
    # speculative verification and a chunk's rows over the cache: row j sees up to its own position
    lens = _run(heads=8, kv_heads=1, dk=64, dv=64, block_size=16, interleave=4, dcp=2, rank=0,
                context_lens=[6, 70], query_lens=[3, 4])
    assert len(set(lens[3:].tolist())) > 1


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_sequence_merged_by_lse(num_splits):
    # more pieces than some rows have tokens: empty pieces (lse -inf) must not disturb the merge
    _run(heads=8, kv_heads=1, dk=64, dv=64, block_size=16, interleave=1, dcp=1, rank=0,
         context_lens=[3, 100, 150], query_lens=[1, 1, 1], num_splits=num_splits)


@pytest.mark.parametrize("mla", [False, True])
def test_a_length_bound_known_in_advance(mla):
    # as in a CUDA graph: the split sized for max_len (more pieces than the rows fill, some wholly past every
    # row's end), with no read of the lengths; the pieces past a row's tokens must merge as nothing
    dk, dv = (72, 64) if mla else (64, 64)
    _run(heads=8, kv_heads=1, dk=dk, dv=dv, block_size=16, interleave=1, dcp=2, rank=1, context_lens=[3, 1, 150],
         query_lens=[1, 1, 1], mla=mla, num_splits=6, max_len=512)


def test_mla_latent():
    # absorbed MLA: 16 heads on one latent of 72 channels, V its first 64 (a view of the key)
    _run(heads=16, kv_heads=1, dk=72, dv=64, block_size=16, interleave=16, dcp=2, rank=1,
         context_lens=[2, 40, 75], query_lens=[1, 1, 2], mla=True, num_splits=2)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_half_caches(cache_dtype):
    _run(heads=8, kv_heads=1, dk=64, dv=64, block_size=16, interleave=1, dcp=1, rank=0, context_lens=[1, 50],
         query_lens=[1, 1], dtype=cache_dtype, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mla", [False, True])
def test_fp8_caches_with_scales(mla):
    dk, dv = (72, 64) if mla else (32, 32)
    _run(heads=8 if mla else 9, kv_heads=1 if mla else 3, dk=dk, dv=dv, block_size=16, interleave=4, dcp=2, rank=1,
         context_lens=[3, 60], query_lens=[1, 2], cache_dtype=FP8_DTYPE, mla=mla, k_scale=0.05, v_scale=0.02)


def test_no_visible_token_anywhere():
    _run(heads=8, kv_heads=1, dk=64, dv=64, block_size=16, interleave=16, dcp=4, rank=3, context_lens=[3, 10],
         query_lens=[1, 1])


@pytest.mark.parametrize("mla", [False, True])
def test_triton_backend_on_a_step_agrees_with_the_reference(mla):
    # the backend reads a step's metadata (groups of decodes, a prefill chunk over a cached prompt,
    # a first chunk with no context) through ContextRows, as the engine hands it over
    from kvshard.attention.backends import make_backend
    from kvshard.attention.metadata import AttentionMetadata
    layout = DCPLayout(16, 2, 4)
    context_lens, query_lens = [2, 40, 130, 50, 0], [1, 1, 1, 3, 2]
    tables = [[(5 * i + 3 * j) % 40 for j in range(8)] for i in range(5)]
    meta = AttentionMetadata.build(context_lens, query_lens, tables, layout, 1, torch.device("cpu"),
                                   decode_group_spread=0)
    cache, q = step_cache(mla, 40, meta.context_rows, 3)
    ref_out, ref_lse = make_backend("reference").attend_context(q, cache, meta, 0.2)
    assert torch.isneginf(ref_lse).any() and torch.isfinite(ref_lse).any()
    _check(*make_backend("triton").attend_context(q, cache, meta, 0.2), ref_out, ref_lse, atol=1e-5, rtol=1e-5)


def test_collectives_on_nccl_only_where_each_rank_has_its_own_gpu(caplog):
    from kvshard.parallel import collective_backend

    assert collective_backend("cpu", 0, 4) == "gloo"
    assert collective_backend("cuda", 8, 8) == "nccl"
    assert collective_backend("cuda", 8, 4) == "nccl"
    with caplog.at_level("WARNING", logger="kvshard.parallel"):
        assert collective_backend("cuda", 1, 2) == "gloo"  # two ranks on one GPU: NCCL would refuse them
    assert "2 ranks share 1 GPU(s)" in caplog.text


# --- the whole model through the Triton backend, on the interpreter ------------------------------

E2E_PROMPTS = [[3, 1, 4], [(7 * i) % 97 + 1 for i in range(21)]]  # the second is chunked: rows over its cache
E2E_NEW_TOKENS = 4
E2E_ENGINE = dict(attention_backend="triton", block_size=16, max_model_len=64, num_kv_blocks=16, max_num_seqs=2,
                  max_num_batched_tokens=12)


def _backend_name(llm):
    return llm.engine.runner.attention_backend.name


def _transformers_steps(hf_reference, path):
    tokens, steps = hf_reference(path, E2E_PROMPTS, E2E_NEW_TOKENS, logprobs=True)
    return tokens, [[dict(enumerate(step.tolist())) for step in prompt_steps] for prompt_steps in steps]


@pytest.mark.parametrize("tp_dcp", [1, 2], ids=["tp1", "tp2-dcp2"])
def test_the_whole_model_through_the_triton_backend_matches_transformers(checkpoints, hf_reference, engine_run,
                                                                        tp_dcp):
    from kvshard import SamplingParams
    from conftest import assert_same_generation, tiny_llama_config

    path = checkpoints("triton-e2e-llama", tiny_llama_config())
    want = _transformers_steps(hf_reference, path)
    params = SamplingParams(temperature=0, max_tokens=E2E_NEW_TOKENS, ignore_eos=True, logprobs=3)
    run = engine_run(path, E2E_PROMPTS, params, probe=_backend_name, tensor_parallel_size=tp_dcp,
                     decode_context_parallel_size=tp_dcp, **E2E_ENGINE)
    assert run.probed == "triton" and "attention backend: triton" in run.config.layout_report()
    assert_same_generation(run.tokens, run.logprobs, *want, atol=1e-4, same_candidates=False)


def test_mla_through_the_triton_backend_under_dcp_matches_transformers(checkpoints, hf_reference, engine_run):
    from transformers import DeepseekV3Config

    from kvshard import SamplingParams
    from conftest import assert_same_generation
    from test_attention_backends import MLA_CONFIG

    path = checkpoints("triton-e2e-mla", DeepseekV3Config(**MLA_CONFIG), seed=4, off_neutral=True)
    want = _transformers_steps(hf_reference, path)
    params = SamplingParams(temperature=0, max_tokens=E2E_NEW_TOKENS, ignore_eos=True, logprobs=3)
    run = engine_run(path, E2E_PROMPTS, params, probe=_backend_name, tensor_parallel_size=2,
                     decode_context_parallel_size=2, **E2E_ENGINE)
    assert run.probed == "triton"
    assert_same_generation(run.tokens, run.logprobs, *want, atol=1e-3, same_candidates=False)


def test_the_triton_backend_is_refused_on_a_cpu_without_the_interpreter(checkpoints, monkeypatch):
    from kvshard.engine.arg_utils import EngineArgs
    from kvshard.errors import ConfigError
    from conftest import tiny_llama_config

    path = str(checkpoints("triton-e2e-llama", tiny_llama_config()))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(triton_paged, "interpreted", lambda: False)
    with pytest.raises(ConfigError, match="attention_backend='triton': no CUDA device, and Triton's interpreter is off"):
        EngineArgs(model=path, attention_backend="triton").create_engine_config()
