"""kvshard against vLLM online on a recorded trace: both servers in turn, the same requests, alternating.

    VLLM_PY=/path/to/vllm-venv/bin/python .venv/bin/python scripts/trace_vs_vllm.py \
        --model smollm2-135m-instruct --dtype float32 --context-scale 1/16 [--rounds 2] [--out DIR]

For each round: `kvshard serve MODEL` starts, `kvshard bench serve --workload trace` replays the trace's
conversations against it, it stops; then `vllm serve` of the same checkpoint and dtype, the same replay,
stopped. Prefix caching is on in both (vLLM with --enable-prompt-tokens-details, so that it reports the
cached tokens too), and both have the same KV budget. Every run's JSON lands in --out; the table at the end
gives each run's output tok/s, TPOT, TTFT and the share of prompt tokens served from the cache, and kvshard
against the mean of vLLM's rounds. The load average is printed around each run: only quiet runs count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvshard.bench.cli import _scale  # noqa: E402
from kvshard.bench.report import format_table  # noqa: E402
from kvshard.bench.serve import run_serve_benchmark  # noqa: E402
from kvshard.bench.server import ServerProcess  # noqa: E402
from kvshard.bench.traces import TraceSpec  # noqa: E402
from kvshard.config import resolve_model_path  # noqa: E402


class Server(ServerProcess):
    """A server process of either engine: `command` is built from the port."""

    def __init__(self, make_command, log_path: Path, env: dict[str, str] | None = None) -> None:
        super().__init__("", [], log_path, startup_timeout=600)
        self.make_command = make_command
        self.env = env

    @property
    def command(self) -> list[str]:
        return self.make_command(self.port)


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--trace", default=str(ROOT / "traces" / "mooncake_synthetic_trace.jsonl"))
    parser.add_argument("--context-scale", type=_scale, default=_scale("1/16"))
    parser.add_argument("--output-scale", type=_scale, default=1.0)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-gib", type=int, default=2, help="KV cache GiB of each engine")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engines", default="kvshard,vllm")
    parser.add_argument("--kvshard-flags", default="", help="extra `kvshard serve` flags")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    vllm_py = os.environ.get("VLLM_PY", "")
    engines = args.engines.split(",")
    if "vllm" in engines and not vllm_py:
        parser.error("set VLLM_PY to the python of a vLLM virtual environment (or --engines kvshard)")
    path = str(resolve_model_path(args.model))
    out = Path(args.out or ROOT / "bench-results" / f"trace-vs-vllm-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    spec = TraceSpec(args.trace, vocab_size=vocab, context_scale=args.context_scale, output_scale=args.output_scale,
                     conversations=args.conversations, max_model_len=args.max_model_len, timing="closed")
    replay = spec.build()
    print(f"workload: {spec.describe()}; {replay.info['num_requests']} requests, "
          f"{replay.info['input_tokens']:,} prompt / {replay.info['output_tokens']:,} output tokens; "
          f"{args.max_concurrency} conversations in flight; results in {out}", flush=True)

    def kvshard_command(port: int) -> list[str]:
        return [str(ROOT / ".venv" / "bin" / "kvshard"), "serve", args.model, "--dtype", args.dtype,
                "--max-model-len", str(args.max_model_len), "--kv-cache-memory", f"{args.kv_gib}GiB",
                *args.kvshard_flags.split(), "--host", "127.0.0.1", "--port", str(port)]

    def vllm_command(port: int) -> list[str]:
        return [vllm_py, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--served-model-name",
                args.model, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                "--enable-prefix-caching", "--enable-prompt-tokens-details", "--host", "127.0.0.1",
                "--port", str(port)]

    rows, results = [], {}
    for round_ in range(1, args.rounds + 1):
        for engine in engines:
            make = kvshard_command if engine == "kvshard" else vllm_command
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
            server = Server(make, out / f"server-{engine}-{round_}.log")
            print(f"== {engine} round {round_}: {' '.join(make(0))}", flush=True)
            with server:
                before = load()
                result = run_serve_benchmark(server.base_url, replay.sessions, model=args.model,
                                             max_concurrency=args.max_concurrency, num_ranks=1, progress=False,
                                             label=f"{engine} {round_}")
                after = load()
            result["trace"] = replay.info
            result["load_before_after"] = [before, after]
            (out / f"{engine}-{round_}.json").write_text(json.dumps(result, indent=2) + "\n")
            results.setdefault(engine, []).append(result)
            rows.append([f"{engine} {round_}", f"{result['output_throughput']:.1f}",
                         f"{result['total_token_throughput']:.0f}",
                         f"{result['median_tpot_ms']:.1f}", f"{result['median_ttft_ms']:.0f}",
                         f"{result['p90_ttft_ms']:.0f}", f"{result['median_itl_ms']:.1f}",
                         "n/a" if result["cached_fraction"] is None else f"{result['cached_fraction']:.0%}",
                         str(result["failed"]), f"{before} / {after}"])
            print(rows[-1], flush=True)
    print(format_table(["run", "out tok/s", "total tok/s", "TPOT p50 ms", "TTFT p50 ms", "TTFT p90 ms",
                        "ITL p50 ms", "cached", "failed", "load before / after"], rows))
    if "kvshard" in results and "vllm" in results:
        peer = statistics.mean(r["output_throughput"] for r in results["vllm"])
        print("kvshard / vLLM output tok/s: " + ", ".join(f"{r['output_throughput'] / peer:.2f}x"
                                                          for r in results["kvshard"]))
    return 0 if all(r["failed"] == 0 for rs in results.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
