"""The kernel extension's fused CPU operators: whether they are on (KVSHARD_FUSED_ELEMENTWISE and a built
extension) and for which tensors, and the attention's LSE merge as one of them.

The model's elementwise operators (layers/fused.py: RMSNorm, SiLU-and-multiply, the rotary embedding) and the
merge of partial attentions by their LSE (`merge_states`: DCP's merge of the ranks' partials, a prefill chunk's
cached context with its own tokens, MLA's expanded pieces) each run as one C++ call of the extension
(attention/csrc/paged_attention.cpp) instead of PyTorch's eager chain of operators. The eager forms stay as
the oracle and for every other case (attention/merge.py's `merge_attention_states` for the merge).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvshard import envs
from kvshard.attention import paged
from kvshard.attention.merge import merge_attention_states

FUSED_DTYPES = (torch.float32, torch.bfloat16)
_ops = None  # the extension, False once it is known to be off or unavailable; None until first asked


def cpu_ops():
    """The extension's module where fused operators are on (KVSHARD_FUSED_ELEMENTWISE, a built kernel), else None."""
    global _ops
    if _ops is None:
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


def merge_states(outputs: Sequence[torch.Tensor] | torch.Tensor,
                 lses: Sequence[torch.Tensor] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_attention_states` of S parts given one by one (outputs [t, H, dv], lses [t, H], float32, any row and
    head strides: views of the parts' packed [o | lse], no stack first) or stacked ([S, t, H, dv], [S, t, H], e.g. a
    collective's buffer): one C++ call of the kernel extension where `ops_for` gives it (a CPU, the switch on), the
    eager operators elsewhere. On a CPU, o and lse are views of one [t, H, dv + 1] (`paged.packed_of` gives it
    back without a copy)."""
    stacked = isinstance(outputs, torch.Tensor)
    first = outputs if stacked else outputs[0]
    ops = ops_for(first)
    if (ops is not None and first.dtype == torch.float32 and first.dim() == 3 + stacked
            and all(o.stride(-1) == 1 for o in ([outputs] if stacked else outputs))):
        merged = ops.merge_stacked(outputs, lses) if stacked else ops.merge_states(list(outputs), list(lses))
        return merged[..., :-1], merged[..., -1]
    if stacked:
        return merge_attention_states(outputs, lses)
    return merge_attention_states(torch.stack(list(outputs)), torch.stack(list(lses)))


def flatten_heads(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [t, H, d] float32 (the attention's output, often a view of the kernel's packed [o | lse]) -> [t, H * d] in
    `dtype`: one C++ call where `ops_for` gives it (float32 or bfloat16), else `.to(dtype).flatten(1)` (the same
    values: rounded to nearest even)."""
    ops = ops_for(x)
    if ops is not None and x.dtype == torch.float32 and x.dim() == 3 and x.stride(-1) == 1 and dtype in FUSED_DTYPES:
        return ops.flatten_heads(x, dtype == torch.bfloat16)
    return x.to(dtype).flatten(1)
