"""The attention kernels and the LSE merge on their own (docs/design.md#verification)."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from kvshard.attention.kernels import attention_with_lse
from kvshard.attention.merge import merge_attention_states


def _random_attention(seed: int, length: int, heads: int = 3, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, heads, dim, generator=g)
    k = torch.randn(1, length, heads, dim, generator=g)
    v = torch.randn(1, length, heads, dim, generator=g)
    return q, k, v


def test_one_part_comes_back_unchanged():
    out = torch.randn(5, 4, 8)
    lse = torch.randn(5, 4)
    merged, merged_lse = merge_attention_states(out.unsqueeze(0), lse.unsqueeze(0))
    assert torch.equal(merged, out)
    assert torch.equal(merged_lse, lse)


def test_equal_lses_average():
    a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    lse = torch.full((2, 3), 1.7)
    merged, merged_lse = merge_attention_states(torch.stack([a, b]), torch.stack([lse, lse]))
    torch.testing.assert_close(merged, (a + b) / 2)
    torch.testing.assert_close(merged_lse, lse + math.log(2))


def test_an_empty_part_contributes_nothing():
    out = torch.randn(2, 3, 4)
    lse = torch.randn(2, 3)
    empty_out = torch.zeros(2, 3, 4)
    empty_lse = torch.full((2, 3), float("-inf"))
    merged, merged_lse = merge_attention_states(torch.stack([empty_out, out]), torch.stack([empty_lse, lse]))
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(merged_lse, lse)


def test_all_parts_empty_gives_zero_not_nan():
    merged, merged_lse = merge_attention_states(torch.zeros(3, 2, 4), torch.full((3, 2), float("-inf")))
    assert torch.equal(merged, torch.zeros(2, 4))
    assert torch.isneginf(merged_lse).all()


def test_merged_shards_equal_full_attention_and_lse_equals_logsumexp_of_scores():
    q, k, v = _random_attention(seed=0, length=13)
    scale = 8 ** -0.5
    full_mask = torch.zeros(1, 1, 13)
    full_out, full_lse = attention_with_lse(q, k, v, full_mask, scale)
    scores = torch.einsum("hd,lhd->hl", q[0, 0], k[0]) * scale
    torch.testing.assert_close(full_lse[0, 0], torch.logsumexp(scores, dim=-1))
    # shard the keys round robin over 4 "ranks" (one of them gets no key at all)
    parts = [list(range(r, 13, 4)) for r in range(4)] + [[]]
    outs, lses = [], []
    for idx in parts:
        if idx:
            o, l = attention_with_lse(q, k[:, idx], v[:, idx], torch.zeros(1, 1, len(idx)), scale)
        else:
            o, l = torch.zeros_like(full_out), torch.full_like(full_lse, float("-inf"))
        outs.append(o)
        lses.append(l)
    merged, merged_lse = merge_attention_states(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(merged, full_out)
    torch.testing.assert_close(merged_lse, full_lse)


def test_grouped_query_heads_read_their_kv_head():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 4, 8, generator=g)  # 4 query heads
    k = torch.randn(1, 5, 2, 8, generator=g)  # 2 KV heads: heads 0,1 -> kv 0; 2,3 -> kv 1
    v = torch.randn(1, 5, 2, 8, generator=g)
    bias = torch.zeros(1, 2, 5).masked_fill_(torch.ones(2, 5, dtype=torch.bool).triu(diagonal=4), float("-inf"))
    out, _ = attention_with_lse(q, k, v, bias, 0.3)
    expanded, _ = attention_with_lse(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2), bias, 0.3)
    torch.testing.assert_close(out, expanded)


def test_a_query_with_no_allowed_key_gets_zero_and_minus_infinity():
    q, k, v = _random_attention(seed=2, length=4)
    out, lse = attention_with_lse(q, k, v, torch.full((1, 1, 4), float("-inf")), 0.5)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


def _causal_bias(s: int) -> torch.Tensor:
    return torch.full((s, s), float("-inf")).triu_(1).unsqueeze(0)


def test_fused_kernel_equals_the_reference_matmuls():
    """The CPU fused-kernel path (decodes folded by KV head, causal chunks, MLA's V as a prefix of K,
    a query with no key) gives what the plain-matmul reference gives."""
    from kvshard.attention.kernels import _flash_applies, reference_attention_with_lse

    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 1, 8, 16, generator=g)
    k = torch.randn(3, 20, 2, 16, generator=g)
    v = torch.randn(3, 20, 2, 16, generator=g)
    lens = torch.tensor([20, 7, 0])  # the last request has no key on this "rank"
    bias = torch.zeros(3, 1, 20).masked_fill_((torch.arange(20) >= lens[:, None]).unsqueeze(1), float("-inf"))
    assert _flash_applies(q, k, v)
    out, lse = attention_with_lse(q, k, v, bias, 0.25)
    ref_out, ref_lse = reference_attention_with_lse(q, k, v, bias, 0.25)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    assert torch.isneginf(lse[2]).all() and torch.equal(out[2], torch.zeros_like(out[2]))

    chunk_q, chunk_k, chunk_v = (torch.randn(1, 9, h, 16, generator=g) for h in (8, 2, 2))
    out, lse = attention_with_lse(chunk_q, chunk_k, chunk_v, None, 0.25, causal=True)
    ref_out, ref_lse = reference_attention_with_lse(chunk_q, chunk_k, chunk_v, _causal_bias(9), 0.25)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)

    latent = torch.randn(3, 20, 1, 24, generator=g)  # MLA: [c_kv | k_pe], V = c_kv
    mla_q = torch.randn(3, 1, 8, 24, generator=g)
    assert _flash_applies(mla_q, latent, latent[..., :16])
    out, lse = attention_with_lse(mla_q, latent, latent[..., :16], bias, 0.25)
    ref_out, ref_lse = reference_attention_with_lse(mla_q, latent, latent[..., :16], bias, 0.25)
    assert out.shape == (3, 1, 8, 16)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


def test_fused_kernel_in_bfloat16_is_close_to_float32():
    from kvshard.attention.kernels import reference_attention_with_lse

    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 1, 4, 32, generator=g), torch.randn(2, 40, 1, 32, generator=g), torch.randn(2, 40, 1, 32, generator=g)
    bias = torch.zeros(2, 1, 40)
    out, lse = attention_with_lse(q.bfloat16(), k.bfloat16(), v.bfloat16(), bias, 0.2)
    ref_out, ref_lse = reference_attention_with_lse(q, k, v, bias, 0.2)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse, ref_lse, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_attention_runs_in_float32_where_the_cpu_has_no_arithmetic_for_it(monkeypatch, causal):
    """On an AVX2-only CPU the fused kernel takes bfloat16 inputs as float32 (layers/linear.py's
    cpu_product_dtype): the same output as the float32 kernel on the same values, bit for bit; MLA's latent
    (V a prefix view of K) stays one tensor."""
    from kvshard.attention import kernels

    monkeypatch.setattr(kernels, "cpu_product_dtype", lambda dtype: torch.float32)
    g = torch.Generator().manual_seed(6)
    s, length = (9, 9) if causal else (1, 40)
    q = torch.randn(2, s, 4, 32, generator=g).bfloat16()
    k, v = (torch.randn(2, length, 1, 32, generator=g).bfloat16() for _ in range(2))
    bias = None if causal else torch.zeros(2, 1, length)
    out, lse = attention_with_lse(q, k, v, bias, 0.2, causal=causal)
    want_out, want_lse = attention_with_lse(q.float(), k.float(), v.float(), bias, 0.2, causal=causal)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    latent = torch.randn(2, length, 1, 48, generator=g).bfloat16()
    out, _ = attention_with_lse(q[..., :1].expand(-1, -1, -1, 48).contiguous(), latent, latent[..., :32], bias,
                                0.2, causal=causal)
    want, _ = attention_with_lse(q[..., :1].expand(-1, -1, -1, 48).float(), latent.float(),
                                 latent.float()[..., :32], bias, 0.2, causal=causal)
    assert out.shape == (2, s, 4, 32) and torch.equal(out, want)


def test_fused_kernel_with_value_and_key_of_different_sizes():
    """MLA's expanded chunk attention: keys of n + r channels, values of v (smaller, padded inside);
    and the other way round."""
    from kvshard.attention.kernels import reference_attention_with_lse

    g = torch.Generator().manual_seed(5)
    for dk, dv in [(24, 8), (8, 24)]:
        q, k, v = torch.randn(1, 7, 4, dk, generator=g), torch.randn(1, 7, 4, dk, generator=g), torch.randn(1, 7, 4, dv, generator=g)
        out, lse = attention_with_lse(q, k, v, None, 0.3, causal=True)
        ref_out, ref_lse = reference_attention_with_lse(q, k, v, _causal_bias(7), 0.3)
        assert out.shape == (1, 7, 4, dv)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(lse, ref_lse)


def test_fused_merge_threshold_comes_from_the_environment(monkeypatch):
    from kvshard.attention.backend import FUSED_MERGE_MAX_BYTES, fused_merge_max_bytes_from_env

    monkeypatch.delenv("KVSHARD_FUSED_MERGE_MAX_BYTES", raising=False)
    assert fused_merge_max_bytes_from_env() == FUSED_MERGE_MAX_BYTES == 256 * 1024
    monkeypatch.setenv("KVSHARD_FUSED_MERGE_MAX_BYTES", "0")
    assert fused_merge_max_bytes_from_env() == 0
    monkeypatch.setenv("KVSHARD_FUSED_MERGE_MAX_BYTES", "256KiB")
    with pytest.raises(ValueError, match="KVSHARD_FUSED_MERGE_MAX_BYTES='256KiB' is not a non-negative integer"):
        fused_merge_max_bytes_from_env()


# --- the merge as one C++ operator of the kernel extension (attention/fused_ops.py's merge_states) ------------

_NO_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is None
needs_extension = pytest.mark.skipif(_NO_COMPILER, reason="no C++ compiler found to build kvshard's kernel extension")


def _parts(seed: int, parts: int, t: int, heads: int, dv: int) -> torch.Tensor:
    """[S, t, H, dv + 1] packed partial attentions, some parts and some whole rows empty (lse -inf, o 0)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(parts, t, heads, dv + 1, generator=g)
    packed[..., -1] *= 4
    empty = torch.rand(parts, t, heads, generator=g) < 0.25
    empty[:, : min(t, 2), 0] = True  # every part of these rows saw no key
    packed[..., :-1][empty] = 0.0
    packed[..., -1][empty] = float("-inf")
    return packed


def _float64_merge(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = packed[..., :-1].double(), packed[..., -1].double()
    total = torch.logsumexp(lse, dim=0)
    weights = torch.where(torch.isneginf(lse), 0.0, (lse - total.nan_to_num(neginf=0.0)).exp())
    return (out * weights.unsqueeze(-1)).sum(0), total


@needs_extension
@pytest.mark.parametrize("parts,t,heads,dv", [(1, 3, 2, 8), (2, 32, 4, 128), (2, 5, 3, 17), (3, 7, 1, 1),
                                              (4, 300, 8, 32)])
def test_the_merge_operator_matches_the_eager_merge_and_a_float64_one(fused_ops, parts, t, heads, dv):
    from kvshard.attention.fused_ops import merge_states

    packed = _parts(parts * 100 + dv, parts, t, heads, dv)
    got_out, got_lse = merge_states(packed[..., :-1], packed[..., -1])  # stacked, as a collective's buffer
    want_out, want_lse = merge_attention_states(packed[..., :-1], packed[..., -1])
    assert got_out.shape == want_out.shape and got_lse.shape == want_lse.shape
    # the eager operators' arithmetic; exp and log a rounding apart from PyTorch's vectorised ones at most
    torch.testing.assert_close(got_out, want_out, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(got_lse, want_lse, rtol=2e-6, atol=1e-6)
    ref_out, ref_lse = _float64_merge(packed)
    torch.testing.assert_close(got_out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    # a row whose every part is empty: o = 0, lse = -inf, no NaN anywhere
    assert torch.equal(got_out[0, 0], torch.zeros(dv)) and torch.isneginf(got_lse[0, 0])
    assert not got_out.isnan().any() and not got_lse.isnan().any()
    # one part comes back as it was
    if parts == 1:
        assert torch.equal(got_out, packed[0, ..., :-1]) and torch.equal(got_lse, packed[0, ..., -1])


@needs_extension
def test_the_merge_operator_reads_strided_parts_given_one_by_one(fused_ops):
    """The context and chunk attentions of a prefill step (separate tensors, views of their packed [o | lse]) and
    a head slice of an all-gathered buffer: no stack or contiguous copy first."""
    from kvshard.attention.fused_ops import merge_states

    packed = _parts(7, 2, 6, 8, 33)
    heads = slice(2, 6)  # this rank's output heads among the group's
    a, b = packed[0][:, heads], packed[1][:, heads]
    assert not a[..., :-1].is_contiguous()
    got_out, got_lse = merge_states([a[..., :-1], b[..., :-1]], [a[..., -1], b[..., -1]])
    want_out, want_lse = merge_attention_states(packed[:, :, heads, :-1].contiguous(), packed[:, :, heads, -1].contiguous())
    torch.testing.assert_close(got_out, want_out, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(got_lse, want_lse, rtol=2e-6, atol=1e-6)
    stacked_out, stacked_lse = merge_states(packed[:, :, heads, :-1], packed[:, :, heads, -1])
    assert torch.equal(stacked_out, got_out) and torch.equal(stacked_lse, got_lse)


@needs_extension
def test_the_merge_operator_does_not_depend_on_the_batch(fused_ops):
    from kvshard.attention.fused_ops import merge_states

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        packed = _parts(9, 2, 600, 8, 64)  # enough rows for both threads
        batch_out, batch_lse = merge_states(packed[..., :-1], packed[..., -1])
    finally:
        torch.set_num_threads(threads)
    for row in (0, 5, 599):
        one_out, one_lse = merge_states(packed[:, row:row + 1, :, :-1], packed[:, row:row + 1, :, -1])
        assert torch.equal(one_out[0], batch_out[row]) and torch.equal(one_lse[0], batch_lse[row])


def test_the_merge_takes_the_eager_operators_where_the_operator_does_not_apply(monkeypatch):
    from kvshard.attention import fused_ops as fused
    from kvshard.attention.fused_ops import merge_states

    packed = _parts(11, 2, 4, 2, 8)
    want_out, want_lse = merge_attention_states(packed[..., :-1], packed[..., -1])
    monkeypatch.setenv("KVSHARD_FUSED_ELEMENTWISE", "0")
    fused.reset()
    try:
        for outputs, lses in ((packed[..., :-1], packed[..., -1]), (list(packed[..., :-1]), list(packed[..., -1]))):
            got_out, got_lse = merge_states(outputs, lses)
            assert torch.equal(got_out, want_out) and torch.equal(got_lse, want_lse)
    finally:
        fused.reset()
    # float64 parts (no operator for them): the eager merge, bit for bit
    got_out, got_lse = merge_states(packed[..., :-1].double(), packed[..., -1].double())
    want64 = merge_attention_states(packed[..., :-1].double(), packed[..., -1].double())
    assert got_out.dtype == torch.float64 and torch.equal(got_out, want64[0]) and torch.equal(got_lse, want64[1])
