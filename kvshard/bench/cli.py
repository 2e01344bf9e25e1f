"""`kvshard bench serve | dcp | throughput | decode-floor`.

kvshard's main CLI calls `add_bench_parser(subparsers)`; `python -m kvshard.bench`
calls `main()` (handy from a peer engine's virtual environment).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from kvshard.bench.text_workload import REPEAT, describe_repeat, repeat_requests
from kvshard.bench.traces import TIMINGS, TraceError, TraceReplay, TraceSpec, read_trace
from kvshard.bench.workloads import MAX_REQUEST_TOKENS, SESSIONS, WORKLOADS, BenchRequest, WorkloadSpec

TRACE = "trace"
from kvshard.config import ConfigError, resolve_model_path
from kvshard.engine.arg_utils import EngineArgs


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: serving load, the TP vs TP+DCP experiment, "
                                                "offline throughput, decode against its bandwidth floor")
    commands = bench.add_subparsers(dest="bench_command", required=True)
    for add in (_add_serve, _add_dcp, _add_throughput, _add_decode_floor):
        add(commands)


def _reporting_errors(run):
    """A benchmark that cannot run (server down, request rejected) ends with one line and exit 1;
    an interrupted one with one line and exit 130."""
    def wrapped(args: argparse.Namespace) -> int:
        from kvshard.bench.serve import BenchmarkError
        from kvshard.bench.server import ServerStartError

        if hasattr(args, "workload"):  # before anything runs: trace flags another workload would ignore
            _check_trace_flags(args)
        try:
            return run(args)
        except (BenchmarkError, ServerStartError) as error:
            print(f"kvshard bench: error: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM; every server started has been stopped on the way out
            print("kvshard bench: interrupted", file=sys.stderr)
            return 130

    return wrapped


def _add_workload_args(parser: argparse.ArgumentParser, workload: str, input_len: int, output_len: int,
                       range_ratio: float, context_scale: str = "1", output_scale: str | None = None,
                       sessions: bool = True, text: bool = False, trace_timing: bool = False) -> None:
    """`sessions`: whether the command can send a session's turns one after another (a server benchmark);
    `text`: whether it offers the `repeat` workload (real text through the model's tokenizer);
    `trace_timing`: whether a trace can be replayed at its recorded arrival times (an online benchmark)."""
    choices = tuple(w for w in WORKLOADS if sessions or w != SESSIONS) + ((REPEAT,) if text else ()) + (TRACE,)
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", choices=choices, default=workload,
                       help=f"random lengths around --input-len/--output-len; agentic: the seed's bimodal "
                            f"long-context shape scaled by --context-scale"
                            + ("; sessions: agentic sessions of --num-turns requests, each turn's prompt the "
                               "previous prompt + its answer + new input" if sessions else "")
                            + ("; repeat: chat requests asking the model to repeat or lightly edit a passage of "
                               "English (where n-gram speculation pays; needs a chat model)" if text else "")
                            + "; trace: replay the requests of a Mooncake-format trace (--trace)"
                            + f" (default {workload})")
    group.add_argument("--input-len", type=int, default=input_len, help=f"random: prompt tokens (default {input_len})")
    group.add_argument("--output-len", type=int, default=output_len,
                       help=f"random: output tokens (default {output_len})")
    group.add_argument("--range-ratio", type=float, default=range_ratio,
                       help=f"random: lengths uniform in [len*(1-r), len*(1+r)] (default {range_ratio})")
    group.add_argument("--context-scale", type=_scale, default=_scale(context_scale),
                       help=f"agentic, sessions, trace: multiply the input lengths (a trace's block size too), "
                            f"e.g. 1/1024 (agentic at 1: 64K-1M long, 2K-64K short; default {context_scale}). "
                            f"No prompt is drawn longer than can be sent: a trace's are cut to fit the max model "
                            f"length, and a workload whose longest request would not fit it (or exceeds "
                            f"{MAX_REQUEST_TOKENS:,} tokens, any model's limit) is refused before a token is drawn")
    group.add_argument("--output-scale", type=_scale, default=output_scale and _scale(output_scale),
                       help=f"agentic, sessions, trace: multiply the output lengths (agentic: median 400 at 1; "
                            f"default: {output_scale or '--context-scale'})")
    if sessions:
        group.add_argument("--num-turns", type=int, default=4,
                           help="sessions: requests per session, each sent once the previous answer is back "
                                "(default 4)")
    trace = parser.add_argument_group("trace workload (Mooncake format: timestamp, input_length, output_length, "
                                      "hash_ids of 512-token blocks)")
    trace.add_argument("--trace", default=None, metavar="PATH",
                       help="the trace file; each hash id becomes a fixed block of token ids, so requests that "
                            "share ids share prompt tokens; --context-scale scales lengths and the block size, "
                            "--output-scale the outputs")
    trace.add_argument("--trace-skip", type=int, default=0,
                       help="start after this many requests of the file (default 0)")
    if sessions:
        trace.add_argument("--trace-conversations", type=int, default=None, metavar="K",
                           help="replay K multi-turn conversations (requests whose hash ids extend an earlier "
                                "request's) as sessions, each turn sent once the previous answer is back "
                                "(default: the window's requests one by one)")
        trace.add_argument("--trace-max-turns", type=int, default=None,
                           help="with --trace-conversations: at most this many turns of each (default: all)")
    if trace_timing:
        trace.add_argument("--trace-timing", choices=TIMINGS, default="timestamps",
                           help="timestamps: send at the recorded arrival times (of the conversations' first "
                                "turns; not with --request-rate: use --time-scale); closed: a closed loop at "
                                "--max-concurrency (default timestamps)")
        trace.add_argument("--time-scale", type=float, default=1.0,
                           help="timestamps: divide the recorded gaps by this, e.g. 10 to replay 10x faster")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="token ids are drawn from [0, V) (default: the model's, when MODEL is local)")


def _trace_flags_given(args: argparse.Namespace) -> list[str]:
    given = [("--trace", args.trace is not None), ("--trace-skip", args.trace_skip != 0),
             ("--trace-conversations", getattr(args, "trace_conversations", None) is not None),
             ("--trace-max-turns", getattr(args, "trace_max_turns", None) is not None)]
    return [flag for flag, set_ in given if set_]


def _check_trace_flags(args: argparse.Namespace) -> None:
    """Trace flags without `--workload trace` would be ignored: say so rather than run another workload."""
    if args.workload != TRACE and (flags := _trace_flags_given(args)):
        raise ConfigError(f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} for a trace replay: add "
                          f"--workload trace (the workload is {args.workload})")


def _workload_spec(args: argparse.Namespace, vocab_size: int) -> WorkloadSpec:
    return WorkloadSpec(
        kind=args.workload, vocab_size=vocab_size, seed=args.seed, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, context_scale=args.context_scale, output_scale=args.output_scale,
        num_turns=getattr(args, "num_turns", WorkloadSpec.num_turns),
    )


def _trace_spec(args: argparse.Namespace, vocab_size: int, max_model_len: int | None,
                num_requests: int | None) -> TraceSpec:
    if not args.trace:
        raise ConfigError("--workload trace needs --trace PATH (a Mooncake-format JSON-lines file)")
    conversations = getattr(args, "trace_conversations", None)
    if getattr(args, "trace_max_turns", None) is not None and conversations is None:
        raise ConfigError("--trace-max-turns caps the turns of --trace-conversations: give both")
    return TraceSpec(
        path=args.trace, vocab_size=vocab_size, seed=args.seed, context_scale=args.context_scale,
        output_scale=args.output_scale, skip=args.trace_skip, num_requests=None if conversations else num_requests,
        conversations=conversations, max_turns=getattr(args, "trace_max_turns", None), max_model_len=max_model_len,
        timing=getattr(args, "trace_timing", "closed"), time_scale=getattr(args, "time_scale", 1.0))


def _build_trace(spec: TraceSpec, limit: str = "--max-model-len") -> TraceReplay:
    """The replay, with one line saying what it is and what had to be cut to fit (`limit`: where the length that
    cut it came from)."""
    try:
        replay = spec.build()
    except TraceError as error:
        raise ConfigError(str(error)) from None
    info = replay.info
    cut = ""
    if info["cut_prompts"] or info["cut_outputs"]:
        cut = (f"; cut to fit {limit} {spec.max_model_len:,}: {info['cut_prompts']} prompts, "
               f"{info['cut_outputs']} outputs")
    print(f"workload: {spec.describe()}; {info['num_requests']:,} requests"
          + (f" in {info['num_sessions']} conversations" if spec.conversations else "")
          + f" (lines {info['first_line']}-{info['last_line']} of {info['file_requests']:,}), "
            f"{info['input_tokens']:,} prompt and {info['output_tokens']:,} output tokens{cut}")
    return replay


def _trace_result(replay: TraceReplay, requests: list[BenchRequest]) -> dict:
    from kvshard.bench.serve import request_list_digest

    return {**replay.info, "requests_digest": request_list_digest(requests)}


def _repeat_workload(model: str | None, num: int) -> tuple[list[BenchRequest], str]:
    """The repeat workload's requests, tokenized by `model`'s own tokenizer (a local checkpoint or name)."""
    if model is None:
        raise ConfigError("the repeat workload needs the model's tokenizer: pass --model (a local checkpoint)")
    try:
        return repeat_requests(resolve_model_path(model), num), describe_repeat(num)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def model_vocab_size(model: str) -> int:
    """vocab_size from the config.json of a local checkpoint or built-in demo model."""
    config = json.loads((resolve_model_path(model) / "config.json").read_text())
    return int(config["vocab_size"])


def _vocab_size(args: argparse.Namespace, *models: str | None) -> int:
    """--vocab-size, else that of the first of `models` found on this machine."""
    if args.vocab_size is not None:
        return args.vocab_size
    for model in models:
        if model is None:
            continue
        try:
            return model_vocab_size(model)
        except (ConfigError, OSError, KeyError):
            continue
    raise ConfigError("cannot find the model's config.json on this machine to read its vocabulary size: "
                      "pass --vocab-size")


def _scale(text: str) -> float:
    """A positive factor: 0.25 or 1/4."""
    try:
        numerator, _, denominator = text.partition("/")
        value = float(numerator) / float(denominator or 1)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a scale factor: use e.g. 0.25 or 1/1024") from None
    if not (value > 0 and math.isfinite(value)):  # nan and inf would reach round() in every length
        raise argparse.ArgumentTypeError(f"{text!r}: the scale must be a positive number")
    return value


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (0 would scrape in a busy loop)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of seconds")
    return value


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,2,4,8")
    return values


def _writable_dir(path: Path, flag: str) -> Path:
    """`path`, created if need be, once a file could be written in it: checked before a run, which must not
    end, minutes later, with a result it cannot save."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as error:
        raise ConfigError(f"{flag}: cannot write in {path} ({error.strerror or error})") from None
    return path


def _check_result_file(path: str | None) -> None:
    if path is None:
        return
    if Path(path).is_dir():
        raise ConfigError(f"--result-file {path} is a directory: give the JSON file's name")
    _writable_dir(Path(path).resolve().parent, f"--result-file {path}")


def _timestamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")


# --- serve -------------------------------------------------------------------------------------

def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def _add_serve(commands) -> None:
    parser = commands.add_parser("serve", help="load generator against an OpenAI-compatible server",
                                 description="Send token-id completions (streamed, ignore_eos) to a running server "
                                             "and report throughput, TTFT/TPOT/ITL and the server's peak KV usage "
                                             "and running requests from its /metrics.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first model); "
                                                      "also where the vocabulary size is read when it is local")
    parser.add_argument("--num-prompts", type=int, default=100,
                        help="requests to send; with --workload sessions, sessions; with --workload trace, the "
                             "window's requests (not with --trace-conversations) (default %(default)s)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests (sessions) in flight at most (default: no limit)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals (of sessions) per second (default inf: all at once); a trace at "
                             "its recorded times (--trace-timing timestamps) refuses it: pace it with --time-scale")
    parser.add_argument("--num-ranks", type=int, default=None,
                        help="ranks serving, for tok/s per rank (default: tp from the server's layout info metric)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--metrics-interval", type=_seconds, default=0.25, help="seconds between /metrics scrapes")
    parser.add_argument("--result-file", default=None,
                        help="write the result as JSON here; a run stopped by Ctrl-C or SIGTERM writes what it "
                             "measured, marked interrupted, to NAME-interrupted.json beside it")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--extra-body", type=_json_object, default=None,
                        help="a JSON object whose fields are added to every request, e.g. "
                             "'{\"response_format\": {\"type\": \"json_object\"}}'")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the longest request the server takes: a trace's prompts are cut so that prompt + "
                             "output fit it; a random, agentic or sessions workload whose longest request does not "
                             "fit it is refused before a token is drawn (default: the server's max_model_len from "
                             "/v1/models)")
    _add_workload_args(parser, "random", input_len=1024, output_len=128, range_ratio=0.0, text=True,
                       trace_timing=True)
    parser.set_defaults(func=_reporting_errors(_run_serve))


def _check_trace_timing(args: argparse.Namespace) -> None:
    """A Poisson rate and recorded arrival times are two schedules for the same requests; rather than follow one
    and drop the other without a word, the pair is refused (--time-scale is how recorded times are paced)."""
    if args.workload == TRACE and args.trace_timing == "timestamps" and math.isfinite(args.request_rate):
        raise ConfigError(f"--request-rate {args.request_rate:g} does not apply to --trace-timing timestamps, which "
                          f"sends each request at its recorded time: use --time-scale F to replay F times faster "
                          f"(or slower, below 1), or --trace-timing closed for arrivals at the rate")


def _reported_max_model_len(entry: dict) -> int | None:
    """The context limit a server gives in /v1/models (kvshard and vLLM do), if it gives a usable one."""
    value = entry.get("max_model_len")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 2 else None


def _interrupted_path(result_file: str) -> Path:
    """r.json -> r-interrupted.json: a partial run neither overwrites an earlier whole one nor passes for one."""
    path = Path(result_file)
    return path.with_name(f"{path.stem}-interrupted{path.suffix or '.json'}")


def _report_interrupted(result: dict | None, result_file: str | None) -> None:
    """What a `bench serve` stopped by Ctrl-C or SIGTERM measured: printed, and with --result-file saved beside it,
    as `bench dcp` keeps its points in dcp-interrupted.json. Requests in flight at the stop are not in it."""
    from kvshard.bench.report import format_serve_result, write_json

    if result is None:
        print("stopped early: no request had finished, nothing measured")
        return
    print(format_serve_result(result))
    finished = f"{result['completed'] + result['failed']} of {result['num_prompts']} requests that finished"
    if not result_file:
        return
    path = _interrupted_path(result_file)
    try:
        write_json(path, result)
    except OSError as error:
        print(f"stopped early: the {finished} could not be saved to {path}: {error.strerror or error}")
        return
    print(f"stopped early: the {finished} are in {path}")


def _run_serve(args: argparse.Namespace) -> int:
    from kvshard.bench.report import format_serve_result, write_json
    from kvshard.bench.serve import BenchmarkError, BenchmarkInterrupted, run_serve_benchmark

    from kvshard.bench.serve import served_model_entry, served_model_root

    _check_result_file(args.result_file)
    _check_trace_timing(args)
    arrival_times, trace = None, None
    if args.workload == TRACE:
        if args.trace_timing == "closed" and not args.max_concurrency:
            raise ConfigError("--trace-timing closed needs --max-concurrency (the requests in flight)")
        _trace_spec(args, 2, None, args.num_prompts)  # the settings (the vocabulary, the server's, aside)
        try:  # and the file's faults, before any the server could have
            read_trace(args.trace)
        except TraceError as error:
            raise ConfigError(str(error)) from None
        entry = served_model_entry(args.base_url, args.model, args.api_key)
        vocab = _vocab_size(args, args.model, *([] if args.vocab_size is not None else [entry.get("root")]))
        spec = _trace_spec(args, vocab, args.max_model_len or _reported_max_model_len(entry), args.num_prompts)
        replay = _build_trace(spec, "--max-model-len" if args.max_model_len else "the server's max_model_len")
        sessions, described = replay.sessions, spec.describe()
        if spec.timing == "timestamps":
            arrival_times = [t / spec.time_scale for t in replay.arrivals_s]
        trace = _trace_result(replay, replay.requests)
    elif args.workload == REPEAT:
        root = args.model if args.model else served_model_root(args.base_url, None, args.api_key)
        requests, described = _repeat_workload(root, args.num_prompts)
        sessions = [[request] for request in requests]
        print(f"workload: {described}")
    else:
        if args.vocab_size is None:  # the server must say where its checkpoint is, to read the vocabulary
            entry = served_model_entry(args.base_url, args.model, args.api_key)
        else:  # only its context limit is wanted: a server without /v1/models is left for probe() to try
            try:
                entry = {} if args.max_model_len else served_model_entry(args.base_url, args.model, args.api_key)
            except BenchmarkError:
                entry = {}
        spec = _workload_spec(args, _vocab_size(args, args.model, *([] if args.vocab_size is not None
                                                                     else [entry.get("root")])))
        max_model_len = args.max_model_len or _reported_max_model_len(entry)
        if max_model_len:  # before a token is drawn: a request that long would only be refused by the server
            spec.check_fits(max_model_len, "--max-model-len" if args.max_model_len else "the server's max_model_len")
        sessions = spec.sessions(args.num_prompts)
        described = spec.describe()
        print(f"workload: {described}; {sum(len(s) for s in sessions)} requests"
              + (f" in {len(sessions)} sessions" if spec.kind == SESSIONS else ""))
    try:
        result = run_serve_benchmark(
            args.base_url, sessions, model=args.model, max_concurrency=args.max_concurrency,
            request_rate=args.request_rate, seed=args.seed, num_ranks=args.num_ranks, api_key=args.api_key,
            metrics_interval=args.metrics_interval, progress=not args.no_progress, arrival_times=arrival_times,
            extra_body=args.extra_body,
        )
    except BenchmarkInterrupted as stop:
        if stop.result is not None:
            stop.result.update({"workload": described, **({"trace": trace} if trace is not None else {})})
        _report_interrupted(stop.result, args.result_file)
        raise  # the CLI says "interrupted" and exits 130
    result["workload"] = described
    if trace is not None:
        result["trace"] = trace
    print(format_serve_result(result))
    if args.result_file:
        print(f"result: {write_json(args.result_file, result)}")
    return 1 if result["failed"] else 0


# --- dcp ---------------------------------------------------------------------------------------

def _add_dcp(commands) -> None:
    parser = commands.add_parser(
        "dcp", help="the seed's experiment: TP alone vs TP + DCP at the same per-rank KV budget",
        description="Start `kvshard serve` with tp alone and with tp plus each --dcp, at the same per-rank KV "
                    "budget; run the same requests at each --concurrency; print max concurrency reached, tok/s "
                    "per rank, KV usage and what limits each layout; save a PNG plot and the JSON.",
    )
    # every server gets these engine flags; --kv-cache-memory is the same for every layout, --max-num-seqs
    # high so that only KV limits the batch, --max-model-len by default the longest request the workload draws
    EngineArgs.add_cli_args(parser, defaults={"tensor_parallel_size": 2, "kv_cache_memory": "7MiB",
                                              "max_num_seqs": 256}, exclude=("decode_context_parallel_size",))
    parser.add_argument("--dcp", type=int, nargs="+", default=[2], help="DCP sizes to compare with tp alone")
    parser.add_argument("--concurrency", type=_positive_ints, default=[1, 2, 4, 8, 16],
                        help="client concurrencies to sweep (default 1,2,4,8,16); after the last, each layout's "
                             "sweep goes on doubling until it saturates (see --sweep-limit)")
    parser.add_argument("--sweep-limit", type=int, default=256,
                        help="double the concurrency past the last --concurrency until the layout's KV cache "
                             "reached its cap and its throughput stopped rising, or up to this concurrency "
                             "(default %(default)s; 0: only the --concurrency points)")
    parser.add_argument("--prompts-per-concurrency", type=int, default=2,
                        help="each point sends concurrency x this many requests (sessions, with --workload "
                             "sessions) (default 2)")
    parser.add_argument("--output-dir", default=None, help="where the JSON, PNG and server logs go "
                                                           "(default bench-results/dcp-TIMESTAMP)")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--metrics-interval", type=_seconds, default=0.25, help="seconds between /metrics scrapes")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                        help="start every layout's server at once and run their points in turn, so that a machine "
                             "whose speed drifts weighs on each alike (default on a CPU); --no-interleave: one "
                             "server at a time, each layout's sweep after the other's (default where CUDA is: the "
                             "servers would share the GPUs' memory)")
    # defaults: the experiment of BENCHMARKS.md, sized for the demo model on a 2-core CPU
    _add_workload_args(parser, "agentic", input_len=1024, output_len=128, range_ratio=0.0,
                       context_scale="1/512", output_scale="1/2")
    parser.set_defaults(func=_reporting_errors(_run_dcp))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _run_dcp(args: argparse.Namespace) -> int:
    from kvshard.bench.dcp import DCPExperiment, format_dcp_table, format_points_table, run_dcp_experiment
    from kvshard.bench.report import plot_dcp_sweep, write_json

    if args.prompts_per_concurrency < 1:
        raise ConfigError("--prompts-per-concurrency must be at least 1")
    if args.sweep_limit < 0:
        raise ConfigError("--sweep-limit must be at least 0")
    engine_args = EngineArgs.from_cli_args(args)
    vocab_size = _vocab_size(args, args.model)
    if args.workload == TRACE:  # the sweep sends the first concurrency x prompts-per-concurrency of them
        replay = _build_trace(_trace_spec(args, vocab_size, engine_args.max_model_len, None))
        spec, sessions = replay, replay.sessions
        max_model_len = engine_args.max_model_len or max(r.input_len + r.output_len for r in replay.requests)
    else:
        spec = _workload_spec(args, vocab_size)
        if engine_args.max_model_len:  # else it is sized to the workload's longest request
            spec.check_fits(engine_args.max_model_len, "--max-model-len")
        top = max(max(args.concurrency), args.sweep_limit)
        sessions = spec.sessions(top * args.prompts_per_concurrency)
        max_model_len = engine_args.max_model_len or spec.max_request_len()
    # tp, dcp, KV budget and max-num-seqs are set per layout by the experiment
    flags = replace(engine_args, max_model_len=max_model_len).to_cli_args(
        exclude=("tensor_parallel_size", "decode_context_parallel_size", "kv_cache_memory", "max_num_seqs"))
    output_dir = _writable_dir(Path(args.output_dir or f"bench-results/dcp-{_timestamp()}"), "--output-dir")
    experiment = DCPExperiment(
        model=args.model, tp=args.tensor_parallel_size, dcps=args.dcp, concurrencies=sorted(set(args.concurrency)),
        workload=spec, sessions=sessions, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
        server_flags=flags, prompts_per_concurrency=args.prompts_per_concurrency, output_dir=output_dir,
        startup_timeout=args.startup_timeout, metrics_interval=args.metrics_interval, progress=not args.no_progress,
        sweep_limit=args.sweep_limit,
        interleave=args.interleave if args.interleave is not None else not _cuda_available(),
    )
    print(f"workload: {experiment.workload_description}; max-model-len {max_model_len:,}; "
          f"KV {args.kv_cache_memory} per rank")
    result = run_dcp_experiment(experiment)
    print()
    print(format_points_table(result))
    print()
    print(format_dcp_table(result))
    print(f"\nresult: {write_json(output_dir / 'dcp.json', result)}")
    print(f"plot:   {plot_dcp_sweep(result, output_dir / 'dcp.png')}")
    failed = sum(p["failed"] for c in result["configs"] for p in c["points"])
    return 1 if failed else 0


# --- throughput ----------------------------------------------------------------------------------

def _add_throughput(commands) -> None:
    from kvshard.bench.throughput import ENGINES

    parser = commands.add_parser("throughput", help="offline throughput of N requests (kvshard or vLLM)",
                                 description="Generate the workload's N requests (token ids, or the repeat "
                                             "workload's text; ignore_eos) with kvshard.LLM, or with vLLM's LLM "
                                             "for --engine vllm, and print requests/s, output tok/s and total "
                                             "tok/s.")
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--engine", choices=ENGINES, default="kvshard")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1,
                        help="generate the same requests this many times in one engine; report the median")
    parser.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM: no torch.compile")
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--no-progress", action="store_true")
    _add_workload_args(parser, "random", input_len=512, output_len=128, range_ratio=0.5, sessions=False, text=True)
    # a trace offline: its window's requests all at once; they may share prefixes, so the prefix cache is emptied
    # before every timed pass as for any workload
    parser.set_defaults(func=_reporting_errors(_run_throughput))


def _run_throughput(args: argparse.Namespace) -> int:
    from kvshard.bench.report import write_json
    from kvshard.bench.throughput import format_throughput, run_kvshard, run_vllm, throughput_result
    if args.repeats < 1 or args.num_prompts < 1:
        raise ConfigError("--repeats and --num-prompts must be at least 1")
    _check_result_file(args.result_file)
    engine_args = EngineArgs.from_cli_args(args)
    trace = None
    if args.workload == REPEAT:
        requests, described = _repeat_workload(args.model, args.num_prompts)
        longest = max(r.input_len + r.output_len for r in requests)
    elif args.workload == TRACE:
        spec = _trace_spec(args, _vocab_size(args, args.model), engine_args.max_model_len, args.num_prompts)
        replay = _build_trace(spec)
        requests, described = replay.requests, spec.describe()
        longest = max(r.input_len + r.output_len for r in requests)
        trace = _trace_result(replay, requests)
    else:
        spec = _workload_spec(args, _vocab_size(args, args.model))
        if engine_args.max_model_len:  # else it is sized to the workload's longest request
            spec.check_fits(engine_args.max_model_len, "--max-model-len")
        requests, described, longest = spec.requests(args.num_prompts), spec.describe(), spec.max_request_len()
    if engine_args.max_model_len is None:
        engine_args = replace(engine_args, max_model_len=longest)
    if trace is None:
        print(f"workload: {described}; {len(requests)} requests")
    if args.engine == "kvshard":
        times, output_tokens, config = run_kvshard(engine_args, requests, args.repeats, not args.no_progress)
    else:
        # kvshard's resolved settings: vLLM's own dtype "auto" turns a float32 checkpoint into bfloat16
        engine_config = engine_args.create_engine_config()
        vllm_kwargs = {
            "tensor_parallel_size": engine_config.parallel.tensor_parallel_size,
            "max_model_len": engine_config.scheduler.max_model_len,
            "max_num_seqs": engine_config.scheduler.max_num_seqs,
            "max_num_batched_tokens": engine_config.scheduler.max_num_batched_tokens,
            "kv_cache_memory_bytes": engine_config.cache.kv_cache_memory,
            "dtype": str(engine_config.model.dtype).removeprefix("torch."), "seed": engine_config.seed,
            # block size: vLLM CPU needs a multiple of 32, so it keeps its own
            "enforce_eager": args.vllm_enforce_eager,
            "enable_prefix_caching": engine_config.cache.enable_prefix_caching,
        }
        if engine_config.parallel.decode_context_parallel_size > 1:
            vllm_kwargs["decode_context_parallel_size"] = engine_config.parallel.decode_context_parallel_size
        times, output_tokens, config = run_vllm(str(resolve_model_path(args.model)), vllm_kwargs, requests,
                                                args.repeats, not args.no_progress)
    result = throughput_result(args.engine, args.model, requests, times, output_tokens, config)
    result["workload"] = described
    if trace is not None:
        result["trace"] = trace
    print(format_throughput(result))
    if args.result_file:
        print(f"result: {write_json(args.result_file, result)}")
    return 0


# --- decode-floor ---------------------------------------------------------------------------------

def _add_decode_floor(commands) -> None:
    parser = commands.add_parser("decode-floor", help="a large-batch decode step against its memory-bandwidth and compute floors",
                                 description="Time decode steps of --batch-size requests of --context-len tokens and "
                                             "compare them with (weights + live KV bytes) / measured copy bandwidth, "
                                             "and with the step's multiply-adds / a measured product's rate.")
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed (median reported)")
    parser.add_argument("--alternate-eager", type=int, default=0, metavar="ROUNDS",
                        help="then ROUNDS x (a block of --steps compiled steps, a block of eager ones), taking turns, "
                             "on the same engine and requests (tp=1, -O 3)")
    parser.add_argument("--result-file", default=None)
    parser.set_defaults(func=_reporting_errors(_run_decode_floor))


def _run_decode_floor(args: argparse.Namespace) -> int:
    from kvshard.bench.decode_floor import format_decode_floor, measure_decode_floor
    from kvshard.bench.report import write_json

    # before the engine starts, which takes a while: none of these can measure anything
    if min(args.batch_size, args.context_len, args.steps) < 1 or args.alternate_eager < 0:
        raise ConfigError("--batch-size, --context-len and --steps must be at least 1, --alternate-eager at least 0")
    _check_result_file(args.result_file)
    engine_args = EngineArgs.from_cli_args(args)
    # the model's window, unless given, is what the requests need (measure_decode_floor sizes it)
    engine_args = replace(engine_args, max_num_seqs=max(engine_args.max_num_seqs, args.batch_size))
    result = measure_decode_floor(engine_args, args.batch_size, args.context_len, args.steps,
                                  alternate_rounds=args.alternate_eager)
    print(format_decode_floor(result))
    if args.result_file:
        print(f"result: {write_json(args.result_file, result)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvshard.bench")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(subparsers)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except (ConfigError, ValueError) as error:
        print(f"kvshard bench: error: {error}", file=sys.stderr)
        return 2
