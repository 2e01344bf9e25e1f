"""Micro-benchmark of a model's linear products on CPU, bfloat16: every product of a decode step (or of a prefill
chunk) of a model's shapes, by the three ways kvshard can run them.

- `amx`: the kernel extension's AMX tiles from the weight as it lies (layers/linear.py's `amx_or_torch_product`
  below its AMX_LINEAR_ROWS; called directly here at every row count), where the CPU has AMX tiles;
- `onednn`: oneDNN from its reordered copy of the weight (`packed_linear`, the layers' product on other CPUs);
- `torch`: torch's linear from the plain weight (oneDNN's product on it, which reorders as it goes).

Each layer has its own weights, so that a product reads them from memory as a step does (SmolLM2's 30 layers are
212 MB, its LM head 57 MB). Reports the median time of the whole set of products per way, the ways timed in turn
round after round (so that other load falls on all), and the weights' bytes per second; the results of each way are
checked against the float32 product first.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_linear.py
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_linear.py --shapes smollm2 --rows 1 32 256 2048
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from kvshard.attention import paged
from kvshard.layers.linear import ONEDNN_LINEAR, amx_linear_weight, onednn_reordered, packed_linear

# name: (layers, [(output features, input features) of a layer's products], the LM head's (vocab, hidden) or None)
SHAPES = {
    # SmolLM2-135M: hidden 576, 9 query heads on 3 KV heads of 64, MLP 1,536, vocabulary 49,152 (tied)
    "smollm2": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576)),
    # kvshard-demo-gqa: hidden 256, 8 query heads on 1 KV head of 32, MLP 768, vocabulary 512
    "gqa-demo": (4, [(320, 256), (256, 256), (1536, 256), (256, 768)], (512, 256)),
    # one layer of Llama-3-8B: hidden 4,096, 32 query heads on 8 KV heads of 128, MLP 14,336
    "llama8b-layer": (1, [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)], None),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["smollm2", "gqa-demo"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 64, 128, 256, 384, 2048])
    parser.add_argument("--repeat", type=int, default=7, help="rounds, each timing every way once (default 7)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    amx = amx_linear_weight(torch.empty(16, 32, dtype=torch.bfloat16))
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}; AMX tiles: {'yes' if amx else 'no'}; oneDNN's packed linear: "
          f"{'yes' if ONEDNN_LINEAR is not None else 'no'}")
    extension = paged.load_extension() if amx else None
    torch.manual_seed(0)
    print("| shapes | rows | amx ms | onednn ms | torch ms | amx GB/s | onednn GB/s | torch GB/s | onednn / amx |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        layers, products, head = SHAPES[name]
        weights = [torch.randn(n, k, dtype=torch.bfloat16) / k ** 0.5 for _ in range(layers) for n, k in products]
        if head is not None:
            weights.append(torch.randn(*head, dtype=torch.bfloat16) / head[1] ** 0.5)
        packed = [onednn_reordered(w) for w in weights] if ONEDNN_LINEAR is not None else None
        total = sum(w.numel() * w.element_size() for w in weights)
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {w.shape[1] for w in weights}}
            ways = {"torch": lambda w, i: torch.nn.functional.linear(inputs[w.shape[1]], w)}
            if packed is not None:
                ways["onednn"] = lambda w, i: packed_linear(inputs[w.shape[1]], packed[i])
            if extension is not None:
                ways["amx"] = lambda w, i: extension.amx_linear(inputs[w.shape[1]], w, None)
            for way, product in ways.items():  # every way within a bfloat16 rounding of the float32 product
                for i in (0, len(weights) - 1):
                    want = inputs[weights[i].shape[1]].float() @ weights[i].float().T
                    error = (product(weights[i], i).float() - want).abs().max().item()
                    if error > want.abs().max().item() * 2 ** -7:
                        raise SystemExit(f"{way} at {rows} rows: off by {error:.3g} from the float32 product")
            times: dict[str, list[float]] = {way: [] for way in ways}
            for _ in range(args.repeat):
                for way, product in ways.items():
                    start = time.perf_counter()
                    for i, w in enumerate(weights):
                        product(w, i)
                    times[way].append(time.perf_counter() - start)
            med = {way: statistics.median(t) for way, t in times.items()}

            def cell(way: str, rate: bool = False) -> str:
                if way not in med:
                    return "-"
                return f"{total / med[way] / 1e9:.1f}" if rate else f"{med[way] * 1e3:.2f}"

            ratio = f"{med['onednn'] / med['amx']:.2f}x" if "amx" in med and "onednn" in med else "-"
            print(f"| {name} | {rows} | {cell('amx')} | {cell('onednn')} | {cell('torch')} | {cell('amx', True)} | "
                  f"{cell('onednn', True)} | {cell('torch', True)} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
