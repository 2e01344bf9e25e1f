"""Attention kernels that return the log-sum-exp of the scores with the output.

The LSE is what lets partial attentions over disjoint key sets be merged exactly
(attention/merge.py). All LSEs are natural-log and float32; a query that may
attend to no key gets output 0 and `lse = -inf`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvshard.attention.merge import merge_attention_states
from kvshard.layers.batch_invariant import batch_invariant_active
from kvshard.layers.cpu_dtypes import cpu_product_dtype

# PyTorch's fused CPU attention (flash-style, tiled, one pass) returns the log-sum-exp with the
# output; it is what `scaled_dot_product_attention` runs on CPU. On CUDA, a chunk's own causal
# attention runs PyTorch's fused CUDA kernels that return the LSE (flash for 16-bit inputs, the
# memory-efficient one for float32); attention over cached context on CUDA is the Triton backend's
# (attention/triton_paged.py), or, with the gather backend, the reference below tile by tile over the
# keys (`tiled_attention_with_lse`). The reference in plain matmuls is what remains (the test oracle).
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of the scores.

    q [g, s, H, dk], k [g, L, Hk, dk], v [g, L, Hk, dv], bias [g, s or 1, L] added to the scores
    (0 where a query may attend, -inf where not), or `causal` (s == L: query i sees keys <= i)
    with no bias, or neither (every query sees every key). Query head h reads KV head h // (H / Hk).
    Returns o [g, s, H, dv], lse [g, s, H], float32; a query with no allowed key gets o = 0,
    lse = -inf.
    """
    if bias is None and _amx_applies(q, k, v):
        return _amx_attention_with_lse(q, k, v, scale, causal)
    if _flash_applies(q, k, v):
        return _flash_attention_with_lse(q, k, v, bias, scale, causal)
    if bias is None and q.device.type == "cuda" and k.dtype == q.dtype == v.dtype:
        return _cuda_attention_with_lse(q, k, v, scale, causal)
    if causal:
        s = q.shape[1]
        bias = torch.full((s, s), float("-inf"), device=q.device).triu_(1).unsqueeze(0)
    elif bias is None:
        bias = torch.zeros(q.shape[0], 1, k.shape[1], device=q.device)
    if q.device.type != "cpu":  # a GPU's cached context with a bias (the gather backend): tile by tile
        return tiled_attention_with_lse(q, k, v, bias, scale)
    return reference_attention_with_lse(q, k, v, bias, scale)


# Keys per tile of `tiled_attention_with_lse`: the scores held at once are [g, H, s, KEY_TILE].
KEY_TILE = 1024


def tiled_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, tile: int = KEY_TILE
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_with_lse over `tile` keys at a time, the tiles' partial attentions merged by their LSE
    (attention/merge.py): what runs on a GPU where no fused kernel applies (the gather backend's decodes
    and chunks over cached context), so that no path there holds the whole score matrix of a long context."""
    length = k.shape[1]
    if length <= tile:
        return reference_attention_with_lse(q, k, v, bias, scale)
    outs, lses = [], []
    for start in range(0, length, tile):
        keys = slice(start, min(start + tile, length))
        o, l = reference_attention_with_lse(q, k[:, keys], v[:, keys], bias[..., keys], scale)
        outs.append(o)
        lses.append(l)
    return merge_attention_states(torch.stack(outs), torch.stack(lses))


def _flash_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    if _CPU_FLASH is None or q.device.type != "cpu" or q.dtype not in _FLASH_DTYPES:
        return False
    return k.dtype == q.dtype and v.dtype == q.dtype


AMX_HEAD_SIZES = (32, 64, 128)
# The paged kernel's AMX path, registered by kvshard.attention.paged (which builds the kernel and imports this
# module): (whether it runs here, the call), or None where that module is not loaded.
_amx_path: tuple[Callable[[], bool], Callable[..., tuple[torch.Tensor, torch.Tensor]]] | None = None


def register_amx_path(ready: Callable[[], bool], run: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
    global _amx_path
    _amx_path = (ready, run)


def _amx_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """bfloat16 on a CPU with bfloat16 arithmetic whose kernel build has the AMX path (`paged.amx_ready`), one head
    size of 32, 64 or 128, the batch-invariant mode off (it keeps the flash kernel's order of sums)."""
    if _amx_path is None or q.device.type != "cpu" or not (q.dtype == k.dtype == v.dtype == torch.bfloat16):
        return False
    if q.shape[-1] not in AMX_HEAD_SIZES or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return False
    return cpu_product_dtype(q.dtype) == q.dtype and not batch_invariant_active() and _amx_path[0]()


def _amx_attention_with_lse(q, k, v, scale, causal):
    """The paged kernel's AMX path (csrc/paged_attention.cpp): the query heads that share a KV head as rows of
    one group, Q·Kᵀ and P·V on the tiles, the softmax in float32; o [g, s, H, d], lse [g, s, H] float32."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return _amx_path[1](q, k, v, scale, causal)


def _is_prefix_view(v: torch.Tensor, k: torch.Tensor) -> bool:
    """v is k[..., :dv] (MLA reads its latent cache's leading channels as V)."""
    return v.data_ptr() == k.data_ptr() and v.stride() == k.stride() and v.shape[:-1] == k.shape[:-1]


def _flash_attention_with_lse(q, k, v, bias, scale, causal):
    g, s, num_heads, dk = q.shape
    num_kv_heads, dv = k.shape[2], v.shape[-1]
    # the kernel wants one head size: zero channels change no score and add no output
    if dv < dk:
        # MLA's latent: V is K's leading channels, so attend over all of K's and keep V's
        v = k if _is_prefix_view(v, k) else torch.nn.functional.pad(v, (0, dk - dv))
    elif dv > dk:
        q, k = (torch.nn.functional.pad(x, (0, dv - dk)) for x in (q, k))
        dk = dv
    if cpu_product_dtype(q.dtype) != q.dtype:  # a half precision this CPU has no arithmetic for (AVX2)
        shared = v is k
        q, k = q.float(), k.float()
        v = k if shared else v.float()
    # When every query row sees the same keys (decodes, cached context), the query heads that share
    # a KV head become rows of one "head": each K/V block is then read once, not once per query head.
    fold = not causal and (bias is None or bias.shape[1] == 1) and num_heads > num_kv_heads
    if fold:
        rep = num_heads // num_kv_heads
        qh = q.view(g, s, num_kv_heads, rep, dk).permute(0, 2, 3, 1, 4).reshape(g, num_kv_heads, rep * s, dk)
    else:
        qh = q.transpose(1, 2)
    mask = None if bias is None else bias.to(q.dtype).unsqueeze(1)  # [g, 1, s|1, L]
    out, lse = _CPU_FLASH(qh, k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=mask, scale=scale)
    if fold:  # [g, Hk, rep*s, d] -> [g, s, H, d]
        out = out.view(g, num_kv_heads, rep, s, -1).permute(0, 3, 1, 2, 4).reshape(g, s, num_heads, -1)
        lse = lse.view(g, num_kv_heads, rep, s).permute(0, 3, 1, 2).reshape(g, s, num_heads)
    else:  # [g, H, s, d] -> [g, s, H, d]
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    out = out[..., :dv].float()
    if bias is not None:
        # the kernel gives a query with no allowed key lse = 0 (and o = 0): make that -inf
        empty = torch.isneginf(bias.amax(dim=-1))  # [g, s|1]
        if empty.any():
            lse = lse.masked_fill(empty.unsqueeze(-1), float("-inf"))
    return out, lse


def _cuda_attention_with_lse(q, k, v, scale, causal: bool):
    """Attention on CUDA with its LSE, causal (a chunk's to itself) or unmasked (rows over keys given whole):
    flash (bfloat16 / float16) or the memory-efficient kernel (float32), over [g, H, s, d] with the KV heads
    repeated for GQA."""
    g, s, num_heads, dk = q.shape
    num_kv_heads, dv = k.shape[2], v.shape[-1]
    rep = num_heads // num_kv_heads
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if rep > 1:
        kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    if dv != dk:  # one head size for the kernel: zero channels change no score and add no output
        width = max(dk, dv)
        qh, kh, vh = (torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in (qh, kh, vh))
    if q.dtype in (torch.bfloat16, torch.float16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal, False,
                                                                      scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            qh, kh, vh, None, True, 0.0, causal, scale=scale)[:2]
    return out[..., :dv].transpose(1, 2).float(), lse[..., :s].transpose(1, 2).float()


def reference_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_with_lse in plain matmuls, on any device and dtype (bias required)."""
    g, s, num_heads, dk = q.shape
    length, num_kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    rep = num_heads // num_kv_heads
    qf = q.float().view(g, s, num_kv_heads, rep, dk).permute(0, 2, 3, 1, 4).reshape(g, num_kv_heads, rep * s, dk)
    kf = k.float().permute(0, 2, 3, 1)  # [g, Hk, dk, L]
    scores = torch.matmul(qf, kf).mul_(scale).view(g, num_kv_heads, rep, s, length)
    scores.add_(bias[:, None, None])
    # one pass of exp: o = softmax(scores) @ v, lse = max + log(sum(exp(scores - max)))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max.masked_fill_(~torch.isfinite(row_max), 0.0)  # rows with no key: everything below stays 0
    weights = scores.sub_(row_max).exp_().view(g, num_kv_heads, rep * s, length)
    total = weights.sum(dim=-1)  # [g, Hk, rep*s]
    o = torch.matmul(weights, v.float().transpose(1, 2))  # [g, Hk, rep*s, dv]
    empty = total == 0
    o = o.div_(total.masked_fill(empty, 1.0).unsqueeze(-1))
    lse = (total.log() + row_max.view(g, num_kv_heads, rep * s)).masked_fill_(empty, float("-inf"))
    o = o.view(g, num_kv_heads, rep, s, dv).permute(0, 3, 1, 2, 4).reshape(g, s, num_heads, dv)
    return o, lse.view(g, num_kv_heads, rep, s).permute(0, 3, 1, 2).reshape(g, s, num_heads)
