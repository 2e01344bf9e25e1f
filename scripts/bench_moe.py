"""Micro-benchmark of the routed experts' paths (kvshard/layers/moe.py): the per-expert loop, the grouped batched
products and the kernel extension's fused call (where it runs: AVX-512), and what `auto` takes, on one rank's share
of a model's experts.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_moe.py
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_moe.py --experts 8 --hidden 256 --intermediate 128 --tp 1,2

The defaults are the MLA demo's experts (8 routed, I = 128, D = 256, top-2). Each figure is the median of
`--repeats` timed calls, the paths taken in turn so that other load falls on all of them. Random routing;
random weights (the time does not depend on them).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from kvshard.layers import fused
from kvshard.layers.moe import FusedMoE
from kvshard.parallel import ParallelState

PATHS = ("loop", "grouped", "fused", "auto")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tp", default="1,2", help="tensor parallel sizes (rank 0's experts are timed)")
    parser.add_argument("--tokens", default="1,4,10,32,300")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--expert-parallel", action="store_true",
                        help="rank 0 holds E/tp whole experts (--enable-expert-parallel), not every expert's 1/tp width")
    args = parser.parse_args(argv)

    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; experts {args.experts}, D {args.hidden}, I {args.intermediate}, "
          f"top-{args.top_k}; median of {args.repeats} calls")
    paths = PATHS if fused.ops_for(torch.zeros(1), avx512=True) is not None else tuple(p for p in PATHS if p != "fused")
    print("| dtype | tp (experts x width here) | tokens | " + " | ".join(f"{p} ms" for p in paths) + " |")
    print("|---|---|---|" + "---|" * len(paths))
    generator = torch.Generator().manual_seed(0)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for tp in map(int, args.tp.split(",")):
            parallel = ParallelState(rank=0, world_size=tp, dcp_rank=0, dcp_size=1, dcp_group_index=0,
                                     expert_parallel=args.expert_parallel)
            layer = FusedMoE(args.experts, args.hidden, args.intermediate, dtype, parallel)
            for weight in (layer.w13_weight, layer.w2_weight):
                weight.data.copy_(torch.randn(weight.shape, generator=generator) * 0.05)
            for tokens in map(int, args.tokens.split(",")):
                x = torch.randn(tokens, args.hidden, generator=generator).to(dtype)
                ids = torch.stack([torch.randperm(args.experts, generator=generator)[:args.top_k]
                                   for _ in range(tokens)])
                weights = torch.rand(tokens, args.top_k, generator=generator)
                samples: dict[str, list[float]] = {path: [] for path in paths}
                for path in paths:  # warm-up
                    layer(x, weights, ids, path=path)
                for _ in range(args.repeats):
                    for path in paths:
                        start = time.perf_counter()
                        layer(x, weights, ids, path=path)
                        samples[path].append(time.perf_counter() - start)
                cells = " | ".join(f"{statistics.median(samples[p]) * 1e3:.3f}" for p in paths)
                print(f"| {dtype_name} | {tp} ({layer.num_local_experts} x {layer.intermediate_size}) | {tokens} | "
                      f"{cells} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
