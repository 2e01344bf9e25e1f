"""How a MoE model's routed work would split over the ranks with whole experts on each (`--enable-expert-parallel`).

Runs `bench dcp`'s point (its default workload: agentic prompts x 1/512, outputs x 1/2, seed 0; --requests of
them) through an `LLM` at tp=1, counts at every call of every MoE layer's routed experts the (token, expert)
pairs that rank r of --tp would hold (experts [r*E/tp, (r+1)*E/tp)), and prints, for decode-sized calls and for
prompt chunks apart, the busiest rank's pairs over an even share: the factor by which the rank a step waits for
does more than 1/tp of the routed work. Splitting every expert by width (the default) makes it 1.

    PYTHONPATH=$PWD .venv/bin/python scripts/moe_routing_balance.py
    PYTHONPATH=$PWD .venv/bin/python scripts/moe_routing_balance.py --tp 4 --requests 32
"""

from __future__ import annotations

import argparse
from fractions import Fraction

import torch

from kvshard import LLM, SamplingParams
from kvshard.bench.workloads import WorkloadSpec
from kvshard.layers.moe import FusedMoE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="kvshard-demo")
    parser.add_argument("--tp", type=int, default=2, help="the ranks whose expert-parallel split is counted")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--context-scale", type=Fraction, default=Fraction(1, 512))
    parser.add_argument("--output-scale", type=Fraction, default=Fraction(1, 2))
    parser.add_argument("--vocab-size", type=int, default=512, help="the model's (the demo models': 512)")
    parser.add_argument("--decode-max-tokens", type=int, default=32,
                        help="calls of at most this many tokens count as decode-sized")
    args = parser.parse_args(argv)

    spec = WorkloadSpec("agentic", args.vocab_size, 0, input_len=1024, output_len=128, range_ratio=0.0,
                        context_scale=float(args.context_scale), output_scale=float(args.output_scale))
    requests = [session[0] for session in spec.sessions(max(args.requests, 128))[:args.requests]]
    calls: list[tuple[int, list[int]]] = []  # (tokens, pairs per rank)
    forward = FusedMoE.forward

    def counting_forward(self, x, topk_weights, topk_ids, path="auto"):
        per_rank = torch.bincount((topk_ids.flatten() * args.tp) // self.num_local_experts, minlength=args.tp)
        calls.append((x.shape[0], per_rank.tolist()))
        return forward(self, x, topk_weights, topk_ids, path)

    FusedMoE.forward = counting_forward
    try:
        with LLM(model=args.model, max_num_seqs=32, max_model_len=spec.max_request_len()) as llm:
            llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                         [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0) for r in requests],
                         use_tqdm=False)
    finally:
        FusedMoE.forward = forward
    if not calls:
        print(f"{args.model} has no routed experts")
        return 1
    for name, keep in (("decode-sized calls", lambda t: t <= args.decode_max_tokens),
                       ("prompt chunks", lambda t: t > args.decode_max_tokens)):
        chosen = [pairs for tokens, pairs in calls if keep(tokens)]
        total = sum(sum(p) for p in chosen)
        if not total:
            print(f"{name}: none")
            continue
        busiest = sum(max(p) for p in chosen)
        shares = [sum(p[r] for p in chosen) / total for r in range(args.tp)]
        print(f"{name}: {len(chosen)} calls, {total:,} pairs; each rank's share "
              f"{', '.join(f'{s:.3f}' for s in shares)}; the busiest rank of each call holds "
              f"{busiest / (total / args.tp):.3f}x an even share")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
