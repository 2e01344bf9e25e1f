"""The fused CPU elementwise operators (kvshard/layers/fused.py) against their eager PyTorch forms.

For each operator, dtype and row count: the median time of the fused call and of the eager form, in turn, at a
model's widths (the demo models': hidden 256, MLP 768, 8 query heads and 1 KV head of 32 channels; SmolLM2's:
576, 1,536, 9 and 3 of 64). Rows: a decode step's few requests and a prefill chunk's tokens.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_fused_elementwise.py [--widths smollm2] [--threads 1]

An AVX2 stand-in on an AVX-512 machine: the extension built for -march=haswell in a temporary folder, PyTorch's
operators held to AVX2:

    ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=$PWD .venv/bin/python scripts/bench_fused_elementwise.py --march haswell
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from bench_paged_attention import timed_together  # this folder's: samples of both sides taken in turn

from kvshard.engine.process_setup import keep_freed_memory
from kvshard.layers import fused
from kvshard.layers.activation import silu_and_mul_eager
from kvshard.layers.norm import RMSNorm
from kvshard.layers.rotary import apply_rotary_eager

WIDTHS = {  # hidden, MLP, query heads, KV heads, head size
    "demo": (256, 768, 8, 1, 32),
    "smollm2": (576, 1536, 9, 3, 64),
}


def build_for(march: str):
    """The kernel extension built for `-march=MARCH` in a temporary folder (not the engines' cache)."""
    from torch.utils.cpp_extension import load

    from kvshard.attention import paged

    folder = Path(tempfile.mkdtemp(prefix="kvshard-fused-bench-"))
    source = folder / paged._SOURCE.name
    shutil.copyfile(paged._SOURCE, source)
    return load(name=f"kvshard_fused_bench_{march.replace('-', '_')}", sources=[str(source)],
                extra_cflags=paged._FLAGS + [f"-march={march}"], extra_ldflags=paged._LDFLAGS,
                build_directory=str(folder), verbose=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", choices=sorted(WIDTHS), default="demo")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 2048])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--march", default=None, help="build the extension for this -march (see above)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # as every rank does: a prefill's outputs reuse memory instead of faulting in fresh pages
    ops = build_for(args.march) if args.march else fused.cpu_ops()
    if ops is None:
        raise SystemExit("the fused operators are off or the kernel extension did not build")
    hidden, mlp, heads, kv_heads, d = WIDTHS[args.widths]
    print(f"widths {args.widths}: hidden {hidden}, MLP {mlp}, {heads} + {kv_heads} heads of {d}; "
          f"{torch.get_num_threads()} thread(s); the extension's AVX-512 path: {bool(ops.tiled)}; "
          f"PyTorch's CPU capability: {torch.backends.cpu.get_cpu_capability()}; median us, fused / eager")
    print("| dtype | rows | RMSNorm | SiLU-and-multiply | rotary (q and k) |")
    print("|---|---|---|---|---|")
    torch.manual_seed(0)
    for dtype in fused.FUSED_DTYPES:
        norm = RMSNorm(hidden, 1e-5, dtype)
        for t in args.rows:
            x = torch.randn(t, hidden).to(dtype)
            gate_up = torch.randn(t, 2 * mlp).to(dtype)
            qkv = torch.randn(t, (heads + 2 * kv_heads) * d).to(dtype)
            q = qkv[:, :heads * d].view(t, heads, d)
            k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
            angles = torch.randn(t, d // 2)
            cos, sin = angles.cos(), angles.sin()
            cells = []
            for fast, slow in (
                (lambda: ops.rms_norm(x, norm.weight, norm.eps), lambda: norm.eager(x)),
                (lambda: ops.silu_and_mul(gate_up), lambda: silu_and_mul_eager(gate_up)),
                (lambda: (ops.rotary(q, cos, sin, False), ops.rotary(k, cos, sin, False)),
                 lambda: (apply_rotary_eager(q, cos, sin), apply_rotary_eager(k, cos, sin))),
            ):
                a, b = (seconds * 1e6 for seconds in timed_together([fast, slow], args.repeat))
                cells.append(f"{a:.1f} / {b:.1f} ({b / a:.1f}x)")
            print(f"| {str(dtype).removeprefix('torch.')} | {t} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
