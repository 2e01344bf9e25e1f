"""The dtypes a CPU's matrix products run in: which weight dtypes oneDNN multiplies here, and the dtype a product of
half-precision operands runs in where the CPU has no arithmetic for it (the linear layers, the LM head and the
attention kernels ask)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN's packed linear takes on this CPU: float32, and bfloat16 only where oneDNN has
    a bfloat16 path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU has none, and its reorder raises)."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


def cpu_product_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a CPU matrix product of `dtype` operands runs in: `dtype` itself, or float32 for a half
    precision the CPU has no arithmetic for (bfloat16 and float16 on AVX2, where torch emulates the product
    element by element, 5-6x slower than float32's). A half-precision product accumulates in float32 and
    rounds its result once, and so does the float32 product that stands in for it, rounded back to `dtype`."""
    if dtype in (torch.bfloat16, torch.float16) and dtype not in onednn_dtypes():
        fp16 = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
        if dtype == torch.bfloat16 or fp16 is None or not fp16():
            return torch.float32
    return dtype
