"""Paged attention in Triton: the GPU counterpart of attention/paged.py's C++ kernel.

Each query row of a step reads its sequence's cached K/V (or MLA's latent) through the block
table, where it lies, and gets its output with the natural-log LSE, so DCP's merge by LSE
(attention/merge.py) works on it unchanged. One call serves every row that reads cached context:
decode rows, the cached-context part of a chunked prefill and speculative verification rows
(several rows of one request, each with its own bound). The inputs are those of
`paged.paged_attention`: row r reads sequence `row_seq[r]` and sees its first `row_lens[r]`
local tokens (a DCP rank's share of any interleave is packed densely, kv/layout.py).

The work: one program per (row, KV head, head tile, split). The query heads of a KV head go
together, so each K/V tile is loaded once for all of them; the sequence is cut into `num_splits`
pieces when rows are few, each piece's softmax kept online in float32; a second kernel merges
the pieces by their LSE with the rescale. FP8 e4m3 caches are read with their scales;
bfloat16, float16 and float32 caches as they are.

On a CPU the same kernels run under Triton's interpreter (numpy underneath; what
`TRITON_INTERPRET=1` selects), which is how the suite checks them against the reference without a
GPU (TRITON_INTERPRET=1 must be set before triton is first imported; tests/conftest.py sets it
where no GPU is found): slow, for small shapes only.
No path here materialises the full score matrix: a program holds one tile of scores at a time.
"""

from __future__ import annotations

import math

import torch

try:  # triton is a dependency on Linux; elsewhere the module says why it cannot run
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only where triton is missing
    triton = None
    _IMPORT_ERROR: str | None = f"triton is not installed ({exc})"
else:
    _IMPORT_ERROR = None

if triton is not None:

    @triton.jit
    def _paged_attention_split(
        q_ptr, k_ptr, v_ptr, tables_ptr, row_seq_ptr, row_lens_ptr,
        out_ptr, lse_ptr,
        stride_qt, stride_qh,
        stride_ks, stride_kh,
        stride_vs, stride_vh,
        stride_bt,
        stride_ot, stride_oh, stride_os,
        stride_lt, stride_lh,
        num_heads, group, block_size, tokens_per_split, scale, k_scale, v_scale,
        DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1) // tl.cdiv(group, BLOCK_H)
        head_tile = tl.program_id(1) % tl.cdiv(group, BLOCK_H)
        split = tl.program_id(2)

        seq = tl.load(row_seq_ptr + row)
        seen = tl.load(row_lens_ptr + row)
        start = split * tokens_per_split
        stop = tl.minimum(start + tokens_per_split, seen)

        heads_in_group = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads_in_group < group
        heads = kv_head * group + heads_in_group
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + dk[None, :],
                    mask=head_ok[:, None] & (dk[None, :] < DK), other=0.0).to(tl.float32)
        q = q * scale

        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        for first in range(start, stop, BLOCK_N):
            tokens = first + tl.arange(0, BLOCK_N)
            token_ok = tokens < stop
            block = tl.load(tables_ptr + seq * stride_bt + tokens // block_size, mask=token_ok, other=0)
            slots = block.to(tl.int64) * block_size + tokens % block_size
            k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + dk[None, :],
                        mask=token_ok[:, None] & (dk[None, :] < DK), other=0.0).to(tl.float32) * k_scale
            v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + dv[None, :],
                        mask=token_ok[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32) * v_scale
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_H, BLOCK_N]
            scores = tl.where(token_ok[None, :], scores, float("-inf"))
            new_m = tl.maximum(m, tl.max(scores, 1))
            # every tile holds at least one visible token, so new_m is finite here
            rescale = tl.exp(m - new_m)
            weights = tl.exp(scores - new_m[:, None])
            total = total * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision="ieee")
            m = new_m

        has = total > 0
        o = acc / tl.where(has, total, 1.0)[:, None]
        lse = tl.where(has, m + tl.log(tl.where(has, total, 1.0)), float("-inf"))
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + split * stride_os + dv[None, :], o,
                 mask=head_ok[:, None] & (dv[None, :] < DV))
        tl.store(lse_ptr + row * stride_lt + heads * stride_lh + split, lse, mask=head_ok)

    @triton.jit
    def _merge_splits(
        part_ptr, part_lse_ptr, out_ptr, lse_ptr,
        stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
        stride_ot, stride_oh, num_heads, num_splits,
        DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        dv = tl.arange(0, BLOCK_DV)
        s_ok = s < num_splits
        lses = tl.load(part_lse_ptr + row * stride_lt + head * stride_lh + s, mask=s_ok, other=float("-inf"))
        top = tl.max(lses, 0)
        safe_top = tl.where(top == float("-inf"), 0.0, top)
        weights = tl.where(s_ok, tl.exp(lses - safe_top), 0.0)  # 0 for empty pieces (lse -inf)
        total = tl.sum(weights, 0)
        parts = tl.load(part_ptr + row * stride_pt + head * stride_ph + s[:, None] * stride_ps + dv[None, :],
                        mask=s_ok[:, None] & (dv[None, :] < DV), other=0.0)
        o = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
        lse = tl.where(total > 0, safe_top + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        tl.store(out_ptr + row * stride_ot + head * stride_oh + dv, o, mask=dv < DV)
        tl.store(lse_ptr + row * num_heads + head, lse)


def available() -> str | None:
    """None where the Triton kernels can run here (a CUDA device, or the interpreter on CPU);
    else why not."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if not torch.cuda.is_available() and not interpreted():
        return "no CUDA device, and Triton's interpreter is off (TRITON_INTERPRET=1 before triton is imported)"
    return None


def interpreted() -> bool:
    """Whether triton.jit runs kernels in its interpreter (TRITON_INTERPRET=1 when triton was imported:
    the kernels above were made then)."""
    return _IMPORT_ERROR is None and isinstance(_merge_splits, _interpreted_type())


def _interpreted_type():
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, math.ceil(math.log2(max(1, n)))))


def _splits_for(rows: int, longest: int, block_n: int, device: torch.device, num_splits: int) -> int:
    if num_splits > 0:
        return num_splits
    if longest <= block_n:
        return 1
    units = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    # enough pieces to give every unit a few programs, none shorter than a few tiles
    want = max(1, -(-2 * units // max(1, rows)))
    return max(1, min(want, -(-longest // (4 * block_n)), 64))


def triton_paged_attention(
    q: torch.Tensor,  # [t, H, dk]
    key_cache: torch.Tensor,  # [slots, Hk, dk] or [num_blocks, B, Hk, dk]
    value_cache: torch.Tensor,  # [slots, Hk, dv] or [num_blocks, B, Hk, dv]; may be key_cache[..., :dv]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    row_seq: torch.Tensor,  # [t]
    row_lens: torch.Tensor,  # [t]
    block_size: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int = 0,  # pieces of the sequence per row; 0: chosen from the rows and the device
    block_n: int = 32,  # tokens per tile
    max_len: int | None = None,  # a bound on row_lens known in advance: the lengths are not read back
) -> tuple[torch.Tensor, torch.Tensor]:
    """`paged.paged_attention` in Triton: o [t, H, dv] and lse [t, H], float32, natural log; a row
    that sees no token gets o = 0 and lse = -inf. With `max_len` nothing waits on the device (no
    host read of the lengths, as inside a CUDA graph's capture): the split is sized for max_len and
    the pieces past a row's length do no work."""
    if _IMPORT_ERROR is not None:
        raise RuntimeError(_IMPORT_ERROR)
    if q.device.type == "cpu" and not interpreted():
        raise RuntimeError("the Triton kernels run on CPU tensors only under Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before triton is first imported")
    if key_cache.dim() == 4:
        key_cache, value_cache = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    t, num_heads, dk = q.shape
    num_kv_heads, dv = key_cache.shape[1], value_cache.shape[-1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the cache's last dimension must be contiguous")
    group = num_heads // num_kv_heads
    device = q.device
    q = q if q.stride(-1) == 1 else q.contiguous()
    tables = block_tables.to(device=device, dtype=torch.int32).contiguous()
    seqs = row_seq.to(device=device, dtype=torch.int32).contiguous()
    lens = row_lens.to(device=device, dtype=torch.int32).contiguous()
    out = torch.zeros(t, num_heads, dv, dtype=torch.float32, device=device)
    lse = torch.full((t, num_heads), float("-inf"), dtype=torch.float32, device=device)
    if t == 0:
        return out, lse
    longest = max_len if max_len is not None else int(lens.max())
    if longest == 0:
        return out, lse
    splits = _splits_for(t, longest, block_n, device, num_splits)
    per_split = -(-longest // splits)
    per_split = -(-per_split // block_n) * block_n  # whole tiles per piece
    splits = -(-longest // per_split)
    block_h = min(_pow2(group), 64)
    head_tiles = -(-group // block_h)
    target = out if splits == 1 else torch.empty(t, num_heads, splits, dv, dtype=torch.float32, device=device)
    target_lse = lse if splits == 1 else torch.empty(t, num_heads, splits, dtype=torch.float32, device=device)
    if splits == 1:
        o_strides = (target.stride(0), target.stride(1), 0)
        l_strides = (target_lse.stride(0), target_lse.stride(1))
    else:
        o_strides = (target.stride(0), target.stride(1), target.stride(2))
        l_strides = (target_lse.stride(0), target_lse.stride(1))
    _paged_attention_split[(t, num_kv_heads * head_tiles, splits)](
        q, key_cache, value_cache, tables, seqs, lens, target, target_lse,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1),
        value_cache.stride(0), value_cache.stride(1),
        tables.stride(0),
        *o_strides, *l_strides,
        num_heads, group, block_size, per_split, scale, k_scale, v_scale,
        DK=dk, DV=dv, BLOCK_DK=_pow2(dk), BLOCK_DV=_pow2(dv), BLOCK_H=block_h, BLOCK_N=block_n,
    )
    if splits > 1:
        _merge_splits[(t, num_heads)](
            target, target_lse, out, lse,
            target.stride(0), target.stride(1), target.stride(2), target_lse.stride(0), target_lse.stride(1),
            out.stride(0), out.stride(1), num_heads, splits,
            DV=dv, BLOCK_DV=_pow2(dv), BLOCK_S=_pow2(splits, least=2),
        )
    return out, lse
