"""The model step's elementwise operators fused on CPU: RMSNorm (with the residual add before it), SiLU-and-multiply,
the rotary embedding, the cache write and the attention's LSE merge (attention/fused_ops.py's `merge_states`), each
one C++ call of
kvshard's kernel extension (attention/csrc/paged_attention.cpp) instead of PyTorch's eager chain of a
multiply, a conversion or a reduction per operator. Whether they are on, and for which tensors, is
attention/fused_ops.py's (`cpu_ops`, `ops_for`: the merge runs inside the attention, which the layers import);
this module names them to the layers and says in the start-up report which run.

A decode step of a small model is mostly such dispatches: the GQA demo's bfloat16 step at 8 requests
spent some 0.6 ms of its 3.2 ms in them (BENCHMARKS.md section 22). The arithmetic is the eager
operators' own (float32, rounded to the tensor's dtype where they round); only a float32 sum of
squares adds up in another order, and the merge's exp and log are the C library's. The eager forms in
norm.py, activation.py, rotary.py and merge.py stay: they run on other devices and dtypes, inside a
compiled graph (inductor fuses them itself; the merge runs inside the attention's opaque operator, so
it stays fused there), where the extension cannot be built, for RMSNorm and SiLU where it is built
without AVX-512 (there they were slower than PyTorch's), and with KVSHARD_FUSED_ELEMENTWISE=0; the
tests compare the two.
"""

from __future__ import annotations

import torch

from kvshard import envs
from kvshard.attention.fused_ops import FUSED_DTYPES, cpu_ops, ops_for, reset  # noqa: F401 (the layers' names)


def describe(config, device_type: str | None = None) -> str:
    """The start-up report's line: which elementwise operators the model step runs (and, for a model with routed
    experts, where its router makes its choice)."""
    from kvshard.compilation import compile_unavailable

    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    line = _elementwise(config, device_type)
    if config.model.routed_experts:
        # as TopKRouter asks: the fused operators on (`cpu_ops`) and the step eager (a compiled graph keeps the chain)
        fused_router = (device_type == "cpu" and cpu_ops() is not None
                        and compile_unavailable(config, device_type) is not None)
        line += "; the MoE router's choice: " + ("fused C++" if fused_router else "PyTorch's operators")
    return line


def _elementwise(config, device_type: str) -> str:
    from kvshard.attention import paged
    from kvshard.compilation import compile_unavailable

    three = "RMSNorm, SiLU-and-multiply and rotary embedding"
    eager = f"elementwise operators: PyTorch's eager {three} and LSE merge"
    if device_type != "cpu":
        return f"{eager} (fused on a CPU only)"
    if not envs.get("KVSHARD_FUSED_ELEMENTWISE"):
        return f"{eager} (KVSHARD_FUSED_ELEMENTWISE=0)"
    if paged.load_extension() is None:
        return f"{eager} (the kernel extension is unavailable: {paged.unavailable_reason()})"
    # the attention's LSE merge (attention/merge.py) is float32 whatever the model's dtype, and runs inside the
    # attention's opaque operator also when the model step is compiled
    if config.model.dtype not in FUSED_DTYPES:
        return f"elementwise operators: fused C++ LSE merge; PyTorch's eager {three} (fused for float32 and bfloat16 only)"
    if compile_unavailable(config, device_type) is None:
        return ("elementwise operators: inductor's, fused in the compiled model step; fused C++ cache write and LSE "
                "merge")
    if not paged.load_extension().tiled:
        return ("elementwise operators: fused C++ rotary embedding, cache write and LSE merge; PyTorch's eager "
                "RMSNorm and SiLU-and-multiply (fused on AVX-512 CPUs only; KVSHARD_FUSED_ELEMENTWISE=0 keeps all "
                "eager)")
    return ("elementwise operators: fused C++ RMSNorm (with the residual add before it), SiLU-and-multiply, rotary "
            "embedding, cache write and LSE merge (KVSHARD_FUSED_ELEMENTWISE=0 keeps PyTorch's eager ones)")
