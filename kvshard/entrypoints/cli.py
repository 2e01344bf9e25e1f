"""`kvshard` command line: generate, serve, proxy, bench, plan.

Each subcommand module adds its own parser; errors a user can cause print one
line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

import kvshard
from kvshard.config import ConfigError
from kvshard.engine.arg_utils import EngineArgs


def _add_generate_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="offline generation: print outputs and the KV layout")
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--prompt", action="append", default=None, help="prompt (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from kvshard import LLM, SamplingParams

    prompts = args.prompt or ["Decode context parallelism shards", "The capital of France is", "Hello, world!"]
    # checked before the engine starts, which takes a while
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if any(not prompt for prompt in prompts):
        raise ValueError("--prompt is empty: give the text to continue")
    with LLM(**asdict(EngineArgs.from_cli_args(args))) as llm:
        print(llm.config.layout_report(llm.engine.runner.compile_seconds))
        for output in llm.generate(prompts, params):
            print(f"\n--- {output.prompt!r}\n{output.outputs[0].text!r}  "
                  f"({len(output.outputs[0].token_ids)} tokens, {output.outputs[0].finish_reason})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvshard.bench.cli import add_bench_parser
    from kvshard.entrypoints.proxy import add_proxy_parser
    from kvshard.entrypoints.serve import add_serve_parser
    from kvshard.planner.cli import add_plan_parser

    parser = argparse.ArgumentParser(prog="kvshard", description="LLM serving with Decode Context Parallelism")
    parser.add_argument("-v", "--version", action="version", version=f"%(prog)s {kvshard.__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(subparsers)
    add_serve_parser(subparsers)
    add_proxy_parser(subparsers)
    add_bench_parser(subparsers)
    add_plan_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvshard.engine.executor import EngineDeadError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError) as error:
        print(f"kvshard: error: {error}", file=sys.stderr)
        return 2
    except EngineDeadError as error:  # a rank died, stopped or failed to load: which and why, in one line
        print(f"kvshard: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
