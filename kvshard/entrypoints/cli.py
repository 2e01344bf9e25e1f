"""`kvshard` command line: generate, serve, bench, plan.

Each subcommand module adds its own parser; errors a user can cause print one
line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from kvshard.config import ConfigError
from kvshard.models.demo import DEFAULT_DEMO_MODEL


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags shared by every command that starts an engine (vLLM's names)."""
    parser.add_argument("model", nargs="?", default=DEFAULT_DEMO_MODEL,
                        help=f"checkpoint directory or built-in demo model (default: {DEFAULT_DEMO_MODEL})")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--decode-context-parallel-size", "--dcp", "-dcp", dest="decode_context_parallel_size",
                        type=int, default=1, help="ranks per DCP group (KV sharded along the sequence)")
    parser.add_argument("--dcp-kv-interleave-size", type=int, default=None,
                        help="consecutive tokens per rank (default: $KVSHARD_DCP_KV_INTERLEAVE_SIZE, "
                             "$VLLM_DCP_KV_INTERLEAVE_SIZE, or 1)")
    parser.add_argument("--dcp-replicate-q", action="store_true",
                        help="compute the queries of the whole DCP group on every rank and skip their all-gather")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default=None, help="KV budget per rank, e.g. 64MiB (default 1GiB)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per rank (overrides --kv-cache-memory)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        tensor_parallel_size=args.tensor_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size,
        dcp_kv_interleave_size=args.dcp_kv_interleave_size,
        dcp_replicate_q=args.dcp_replicate_q,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        seed=args.seed,
    )


def _add_generate_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="offline generation: print outputs and the KV layout")
    add_engine_args(parser)
    parser.add_argument("--prompt", action="append", default=None, help="prompt (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from kvshard import LLM, SamplingParams

    prompts = args.prompt or ["Decode context parallelism shards", "The capital of France is", "Hello, world!"]
    with LLM(args.model, **engine_kwargs(args)) as llm:
        print(llm.config.layout_report())
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        for output in llm.generate(prompts, params):
            print(f"\n--- {output.prompt!r}\n{output.outputs[0].text!r}  "
                  f"({len(output.outputs[0].token_ids)} tokens, {output.outputs[0].finish_reason})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvshard.bench.cli import add_bench_parser
    from kvshard.entrypoints.serve import add_serve_parser
    from kvshard.planner.cli import add_plan_parser

    parser = argparse.ArgumentParser(prog="kvshard", description="LLM serving with Decode Context Parallelism")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(subparsers)
    add_serve_parser(subparsers)
    add_bench_parser(subparsers)
    add_plan_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError) as error:
        print(f"kvshard: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
