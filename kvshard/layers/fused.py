"""The model step's elementwise operators fused on CPU: RMSNorm, SiLU-and-multiply and the rotary
embedding, each one C++ call of kvshard's kernel extension (attention/csrc/paged_attention.cpp)
instead of PyTorch's eager chain of a multiply, a conversion or a reduction per operator.

A decode step of a small model is mostly such dispatches: the GQA demo's bfloat16 step at 8 requests
spent some 0.6 ms of its 3.2 ms in them (BENCHMARKS.md section 22). The arithmetic is the eager
operators' own (float32, rounded to the tensor's dtype where they round); only a float32 sum of
squares adds up in another order. The eager forms in norm.py, activation.py and rotary.py stay: they
run on other devices and dtypes, inside a compiled graph (inductor fuses them itself), where the
extension cannot be built, for RMSNorm and SiLU where it is built without AVX-512 (there they were
slower than PyTorch's), and with KVSHARD_FUSED_ELEMENTWISE=0; the tests compare the two.
"""

from __future__ import annotations

import torch

from kvshard import envs

FUSED_DTYPES = (torch.float32, torch.bfloat16)
_ops = None  # the extension, False once it is known to be off or unavailable; None until first asked


def cpu_ops():
    """The extension's module where fused operators are on (KVSHARD_FUSED_ELEMENTWISE, a built kernel), else None."""
    global _ops
    if _ops is None:
        from kvshard.attention import paged

        _ops = (envs.get("KVSHARD_FUSED_ELEMENTWISE") and paged.load_extension()) or False
    return _ops or None


def reset() -> None:
    """Ask again at the next call (after the environment changed: tests)."""
    global _ops
    _ops = None


def ops_for(x: torch.Tensor, avx512: bool = False):
    """The extension where `x` can take a fused operator (a CPU float32 / bfloat16 tensor outside a compiled
    graph), else None. `avx512`: only where the extension is built with AVX-512 (its `tiled` path): RMSNorm and
    SiLU-and-multiply built for AVX2 ran 0.4-0.8x and 0.1-0.3x PyTorch's AVX2 operators at a prefill's rows
    (BENCHMARKS.md section 22), where the rotary embedding still ran 3-15x faster."""
    if x.device.type != "cpu" or x.dtype not in FUSED_DTYPES or torch.compiler.is_compiling():
        return None
    ops = cpu_ops()
    if ops is None or (avx512 and not ops.tiled):
        return None
    return ops


def describe(config, device_type: str | None = None) -> str:
    """The start-up report's line: which elementwise operators the model step runs."""
    from kvshard.attention import paged
    from kvshard.compilation import compile_unavailable

    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    eager = "elementwise operators: PyTorch's eager RMSNorm, SiLU-and-multiply and rotary embedding"
    if device_type != "cpu":
        return f"{eager} (fused on a CPU only)"
    if config.model.dtype not in FUSED_DTYPES:
        return f"{eager} (fused for float32 and bfloat16 only)"
    if not envs.get("KVSHARD_FUSED_ELEMENTWISE"):
        return f"{eager} (KVSHARD_FUSED_ELEMENTWISE=0)"
    if paged.load_extension() is None:
        return f"{eager} (the kernel extension is unavailable: {paged.unavailable_reason()})"
    if compile_unavailable(config, device_type) is None:
        return "elementwise operators: inductor's, fused in the compiled model step"
    if not paged.load_extension().tiled:
        return ("elementwise operators: fused C++ rotary embedding; PyTorch's eager RMSNorm and SiLU-and-multiply "
                "(fused on AVX-512 CPUs only; KVSHARD_FUSED_ELEMENTWISE=0 keeps all three eager)")
    return ("elementwise operators: fused C++ RMSNorm, SiLU-and-multiply and rotary embedding "
            "(KVSHARD_FUSED_ELEMENTWISE=0 keeps PyTorch's eager ones)")
