"""What attention runs on a GPU where the Triton backend does not (kvshard/attention/kernels.py): the
gather backend's attention over cached context goes tile by tile over the keys, merged by LSE, never
holding a long context's whole score matrix. Checked on the CPU: the tiled function against the
reference, and the routing of a non-CPU tensor to it (on the meta device: shapes only). Where a CUDA device is
present (scripts/device_check.sh), torch's fused kernels without a bias, causal and unmasked, against the reference."""

from __future__ import annotations

import pytest
import torch

from kvshard.attention import kernels


def test_tiles_merged_by_lse_equal_the_reference_with_empty_rows_and_gqa():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 8, 16, generator=g)  # [g, s, H, dk]: 8 query heads on 2 KV heads
    k, v = torch.randn(2, 70, 2, 16, generator=g), torch.randn(2, 70, 2, 12, generator=g)
    lens = torch.tensor([[70, 33, 0], [5, 64, 17]])  # a row that sees nothing; one within the first tile
    bias = torch.zeros(2, 3, 70).masked_fill_(torch.arange(70) >= lens[..., None], float("-inf"))
    want_o, want_lse = kernels.reference_attention_with_lse(q, k, v, bias, 0.25)
    got_o, got_lse = kernels.tiled_attention_with_lse(q, k, v, bias, 0.25, tile=16)  # 5 tiles, the last partial
    assert torch.isneginf(got_lse[0, 2]).all() and (got_o[0, 2] == 0).all()
    torch.testing.assert_close(got_o, want_o, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-6, rtol=1e-5)


def test_a_gpu_tensor_with_a_bias_takes_the_tiled_path(monkeypatch):
    calls = []

    def tiled(q, k, v, bias, scale, tile=kernels.KEY_TILE):
        calls.append(tuple(bias.shape))
        return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty(q.shape[:-1])

    monkeypatch.setattr(kernels, "tiled_attention_with_lse", tiled)
    meta = torch.device("meta")
    q, k, v = (torch.empty(1, 1, 4, 16, device=meta), torch.empty(1, 4096, 1, 16, device=meta),
               torch.empty(1, 4096, 1, 16, device=meta))
    kernels.attention_with_lse(q, k, v, torch.empty(1, 1, 4096, device=meta), 0.25)
    assert calls == [(1, 1, 4096)]
    kernels.attention_with_lse(torch.empty(1, 2, 4, 16), torch.empty(1, 2, 1, 16), torch.empty(1, 2, 1, 16),
                               torch.zeros(1, 1, 2), 0.25)  # a CPU tensor: the CPU's fused kernel
    assert len(calls) == 1


def test_no_bias_and_not_causal_lets_every_query_see_every_key():
    """`attend_keys`' call (MLA's long chunks over their expanded context): no mask at all, on the CPU's fused
    kernel (float32) and on the plain path (float64, which it does not take); 64-channel keys, 32-channel values."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 5, 4, 64, generator=g), torch.randn(1, 37, 4, 64, generator=g), \
        torch.randn(1, 37, 4, 32, generator=g)
    want_o, want_lse = kernels.reference_attention_with_lse(q, k, v, torch.zeros(1, 1, 37), 0.125)
    for dtype in (torch.float32, torch.float64):
        got_o, got_lse = kernels.attention_with_lse(q.to(dtype), k.to(dtype), v.to(dtype), None, 0.125)
        torch.testing.assert_close(got_o.float(), want_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_lse.float(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/device_check.sh runs it there)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_on_cuda_torchs_fused_kernels_match_the_reference(dtype, causal):
    """No bias: torch's flash (bfloat16) or memory-efficient (float32) kernel, causal (a chunk's attention to itself)
    or unmasked (`attend_keys`), 8 query heads on 2 KV heads, 192-channel keys and 128-channel values (MLA's)."""
    g = torch.Generator().manual_seed(2)
    s = 40
    q, k, v = torch.randn(1, s, 8, 192, generator=g), torch.randn(1, s, 2, 192, generator=g), \
        torch.randn(1, s, 2, 128, generator=g)
    bias = torch.full((s, s), float("-inf")).triu_(1)[None] if causal else torch.zeros(1, 1, s)
    want_o, want_lse = kernels.reference_attention_with_lse(q.to(dtype).float(), k.to(dtype).float(),
                                                            v.to(dtype).float(), bias, 0.07)
    got_o, got_lse = kernels.attention_with_lse(q.to(dtype).cuda(), k.to(dtype).cuda(), v.to(dtype).cuda(), None, 0.07,
                                                causal=causal)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_o.cpu(), want_o, atol=tol, rtol=tol)
    torch.testing.assert_close(got_lse.cpu(), want_lse, atol=tol, rtol=tol)
