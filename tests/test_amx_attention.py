"""The paged kernel's AMX path (`paged.amx_attention`): bfloat16 attention with no mask at head sizes 32, 64, 128 on
AMX tiles, for a long prefill chunk's attention to itself and to its cached context. PyTorch's flash kernel is its
oracle, and the float32 reference the truth both are held to. Runs where the CPU has AMX tiles (and the kernel's
build has the path); elsewhere the path cannot run and attention never takes it (the routing test still runs)."""

from __future__ import annotations

import pytest
import torch

from kvshard import LLM, SamplingParams
from kvshard.attention import kernels, paged
from kvshard.layers.batch_invariant import batch_invariant_mode
from conftest import hf_greedy_with_logprobs, tiny_llama_config

needs_amx = pytest.mark.skipif(not (paged.kernel_available() and paged.amx_ready()),
                               reason="no AMX tiles on this CPU (or none in its kernel build)")


def _reference(q, k, v, scale, causal):
    s, length = q.shape[1], k.shape[1]
    if causal:
        bias = torch.full((s, length), float("-inf")).triu_(1).expand(q.shape[0], s, length)
    else:
        bias = torch.zeros(q.shape[0], 1, length)
    return kernels.reference_attention_with_lse(q.float(), k.float(), v.float(), bias, scale)


# (requests, rows, keys, query heads, KV heads, head size, causal): GQA groups of 1, 3, 4 and 8 query heads; rows and
# keys that fill no 16-row block or 32-key tile; contexts across 512-key blocks; causal chunks across them
SHAPES = [
    (1, 5, 5, 8, 1, 32, True), (1, 37, 37, 8, 1, 32, True), (2, 70, 70, 9, 3, 64, True), (1, 600, 600, 4, 4, 64, True),
    (1, 1, 1, 8, 1, 32, True), (1, 19, 300, 8, 1, 32, False), (3, 33, 1100, 9, 3, 64, False),
    (1, 1, 17, 4, 1, 32, False), (1, 530, 530, 8, 2, 32, True), (2, 16, 513, 6, 2, 64, False),
    (1, 45, 45, 8, 2, 128, True), (2, 530, 530, 4, 1, 128, True), (1, 21, 1040, 8, 8, 128, False),
]


@needs_amx
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) + ("-causal" if s[6] else ""))
def test_the_amx_path_matches_the_reference_closer_than_the_flash_kernel(shape):
    g, s, length, heads, kv_heads, d, causal = shape
    gen = torch.Generator().manual_seed(sum(shape[:6]))
    q = torch.randn(g, s, heads, d, generator=gen).to(torch.bfloat16)
    # keys and values as the model leaves them: every KV head of a token in one row (strided per head)
    kv = torch.randn(g, length, kv_heads, 2 * d, generator=gen).to(torch.bfloat16)
    k, v = kv[..., :d], kv[..., d:]
    scale = d ** -0.5
    out, lse = paged.amx_attention(q, k, v, scale, causal)
    assert out.shape == (g, s, heads, d) and lse.shape == (g, s, heads) and out.dtype == lse.dtype == torch.float32
    want_out, want_lse = _reference(q, k, v, scale, causal)
    flash_out, flash_lse = kernels._flash_attention_with_lse(q, k, v, None, scale, causal)
    # flash rounds the weights to bfloat16 for P·V, as the AMX path does: both sit within that rounding of the
    # float32 reference, the AMX path no further from it than flash (its LSE far closer: float32 sums throughout)
    torch.testing.assert_close(out, want_out, atol=6e-3, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=0)
    assert (out - want_out).abs().max() <= (flash_out - want_out).abs().max() * 1.25 + 1e-4
    torch.testing.assert_close(out, flash_out, atol=1.2e-2, rtol=0)
    torch.testing.assert_close(lse, flash_lse, atol=2e-4, rtol=0)



# (requests, rows, keys, query heads, KV heads, head size, causal): contexts over two to four key ranges of 512, with
# tails; spans of several row blocks; causal rows whose blocks end before a later range; a context past the default
# range of 16,384 keys
RANGED = [(1, 200, 1700, 8, 1, 32, False), (2, 40, 1100, 9, 3, 64, False), (1, 600, 600, 4, 4, 64, True),
          (1, 21, 1040, 8, 8, 128, False), (1, 16, 17000, 8, 1, 32, False)]


@needs_amx
@pytest.mark.parametrize("shape", RANGED, ids=lambda s: "x".join(map(str, s[:6])) + ("-causal" if s[6] else ""))
def test_a_long_context_packed_a_range_at_a_time_gives_the_same_bits(shape):
    """Keys packed `key_range` at a time (the rows' softmax state kept across ranges, so that the packed copy of a long
    context stays a range's size): the same bits as one range, and the reference's answer."""
    g, s, length, heads, kv_heads, d, causal = shape
    gen = torch.Generator().manual_seed(sum(shape[:6]))
    q = torch.randn(g, s, heads, d, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(g, length, kv_heads, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    scale = d ** -0.5
    whole_out, whole_lse = paged.amx_attention(q, k, v, scale, causal, -(-length // 512) * 512)  # one range
    for key_range in (0, 512, 1024):  # 0: the default's
        out, lse = paged.amx_attention(q, k, v, scale, causal, key_range)
        assert torch.equal(out, whole_out) and torch.equal(lse, whole_lse), key_range
    want_out, want_lse = _reference(q, k, v, scale, causal)
    torch.testing.assert_close(whole_out, want_out, atol=6e-3, rtol=0)
    torch.testing.assert_close(whole_lse, want_lse, atol=1e-5, rtol=0)


@needs_amx
def test_a_key_range_off_the_block_size_is_refused():
    q = torch.randn(1, 4, 8, 32).to(torch.bfloat16)
    k = v = torch.randn(1, 600, 1, 32).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="key_range a multiple of 512"):
        paged.amx_attention(q, k, v, 32 ** -0.5, False, 700)

def test_attention_takes_the_amx_path_only_for_bfloat16_without_a_mask_at_its_head_sizes(monkeypatch):
    calls = []
    monkeypatch.setattr(paged, "amx_attention", lambda *args: calls.append(args[0].shape) or _reference(*args))
    monkeypatch.setattr(kernels, "cpu_product_dtype", lambda dtype: dtype)  # a CPU with bfloat16 arithmetic
    monkeypatch.setattr(paged, "_amx_built", lambda: True)  # as on a CPU with AMX tiles
    monkeypatch.delenv("KVSHARD_AMX_ATTENTION", raising=False)

    def run(dtype=torch.bfloat16, d=32, bias=False, causal=True):
        q = torch.randn(1, 20, 4, d).to(dtype)
        k, v = torch.randn(1, 20, 2, d).to(dtype), torch.randn(1, 20, 2, d).to(dtype)
        mask = torch.zeros(1, 1, 20) if bias else None
        calls.clear()
        kernels.attention_with_lse(q, k, v, mask, d ** -0.5, causal=causal and not bias)
        return bool(calls)

    assert run() and run(d=64) and run(d=128) and run(causal=False)
    assert not run(dtype=torch.float32) and not run(dtype=torch.float16) and not run(d=48) and not run(bias=True)
    with batch_invariant_mode(True):  # the batch-invariant mode keeps flash's order of sums
        assert not run()
    monkeypatch.setenv("KVSHARD_AMX_ATTENTION", "0")
    assert not run()
    monkeypatch.setattr(paged, "_amx_built", lambda: False)  # a CPU without AMX tiles
    monkeypatch.setenv("KVSHARD_AMX_ATTENTION", "1")
    assert not run()
    monkeypatch.setattr(paged, "_amx_built", lambda: True)
    monkeypatch.setattr(kernels, "cpu_product_dtype", lambda dtype: torch.float32)  # no bfloat16 arithmetic (AVX2)
    assert not run()


NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
# prompts of 41-49 tokens in chunks of 24 rows: long chunks after cached context, and after prefix hits
LONG_PROMPTS = [[(17 * i + 5 * p) % 97 + 2 for i in range(41 + 4 * p)] for p in range(3)]
LONG_AGAIN = [prompt + [(13 * i + p) % 89 + 3 for i in range(24)] for p, prompt in enumerate(LONG_PROMPTS)]


def _generate(llm, prompts):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


@needs_amx
@pytest.mark.parametrize("layout", [(1, 1), (2, 2)], ids=["tp1", "tp2-dcp2"])
def test_engines_on_the_amx_path_give_the_flash_kernels_generation(layout, checkpoints, monkeypatch):
    """A bfloat16 GQA model of head size 32 (8 query heads over 2 KV heads), chunked prefill and prefix hits: the
    engine on the AMX path and the same engine on the flash kernel both give each prompt's first token as float32
    transformers does, with log-probabilities close to its and to each other."""
    # seed 4: every greedy step of float32 transformers on these prompts leads its runner-up by 0.2 or more
    path = checkpoints("amx-8q2kv", tiny_llama_config(num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                                      hidden_size=128, intermediate_size=256, initializer_range=0.3),
                       seed=4)
    tp, dcp = layout
    engine = dict(dtype="bfloat16", attention_backend="paged", tensor_parallel_size=tp,
                  decode_context_parallel_size=dcp, block_size=8, max_model_len=128, num_kv_blocks=96,
                  max_num_seqs=4, max_num_batched_tokens=24)
    runs = {}
    for amx in ("1", "0"):
        calls = []
        with monkeypatch.context() as patch:
            patch.setenv("KVSHARD_AMX_ATTENTION", amx)
            if tp == 1:  # one process: count the path's calls
                original = paged.amx_attention
                patch.setattr(paged, "amx_attention", lambda *a: calls.append(a[0].shape[1]) or original(*a))
            with LLM(str(path), **engine) as llm:
                runs[amx] = (_generate(llm, LONG_PROMPTS), _generate(llm, LONG_AGAIN))
                assert llm.engine.stats().prefix_cache_hits > 0
        if tp == 1:
            assert (max(calls, default=0) > 16) is (amx == "1"), calls  # the long chunks went to the AMX path
    # each prompt's first token comes from its prefill alone (the chunks the AMX path attends): float32
    # transformers' token, its log-probability within bfloat16's reach of transformers' on both paths, and the two
    # paths close to each other (the decode steps after it run in the paged kernel's vector loops on both)
    for prompts, amx_run, flash_run in zip((LONG_PROMPTS, LONG_AGAIN), runs["1"], runs["0"]):
        want_tokens, want_steps = hf_greedy_with_logprobs(path, prompts, 1)
        for p, want in enumerate(want_tokens):
            token = want[0]
            amx_logprob = amx_run[1][p][0][token].logprob
            flash_logprob = flash_run[1][p][0][token].logprob
            assert amx_run[0][p][0] == flash_run[0][p][0] == token
            assert amx_logprob == pytest.approx(want_steps[p][0][token].item(), abs=0.15)
            assert flash_logprob == pytest.approx(want_steps[p][0][token].item(), abs=0.15)
            assert amx_logprob == pytest.approx(flash_logprob, abs=0.06)


def test_the_amx_path_never_builds_the_kernel(monkeypatch):
    """A process that has not loaded the kernel (the gather backend's) keeps the flash kernel: asking whether the
    AMX path runs must not build the kernel there."""
    built = []
    monkeypatch.setattr(paged, "_module", None)
    monkeypatch.setattr(paged, "load_extension", lambda: built.append(1))
    assert not paged.amx_ready() and not built
    q = torch.randn(1, 20, 4, 32).to(torch.bfloat16)
    k = torch.randn(1, 20, 2, 32).to(torch.bfloat16)
    kernels.attention_with_lse(q, k, k, None, 0.2, causal=True)
    assert not built
