"""The tools around the server: unusual but valid Mooncake traces, malformed ones, scales that would draw more
tokens than can be sent, a server that answers oddly, outputs that cannot be written, a `bench serve` and a
`bench dcp` that stop early, and planner inputs no plan can come from.

No engine or server starts here: where a command would start one, it is replaced by a stand-in that fails the
test, so each case shows the mistake is caught before anything slow runs.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import socket
import sys
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

import kvshard
from kvshard.bench.cli import main as bench_main
from kvshard.bench.dcp import DCPExperiment, _Sweep, run_dcp_experiment
from kvshard.bench.serve import BenchmarkError, RequestOutcome, probe, send_request, summarize
from kvshard.bench.server import ServerProcess
from kvshard.bench.traces import TraceError, TraceRecord, TraceSpec, conversations, read_trace
from kvshard.bench.workloads import MAX_REQUEST_TOKENS, BenchRequest, WorkloadSpec
from kvshard.entrypoints.cli import main as kvshard_main
from kvshard.planner.cli import main as plan_main

MODEL = "kvshard-demo-gqa"


def request_line(timestamp: float, input_length: int, output_length: int, ids: list[int], **extra) -> str:
    return json.dumps({"timestamp": timestamp, "input_length": input_length, "output_length": output_length,
                       "hash_ids": ids, **extra}, ensure_ascii=False)


def refused_port() -> int:
    """A local port nothing listens on: a server that is down."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def must_not_start(*args, **kwargs):
    raise AssertionError("an engine or server started: the mistake should have been caught before")


# --- Mooncake traces ------------------------------------------------------------------------------

def test_a_byte_order_mark_and_crlf_line_ends_are_read(tmp_path):
    trace = tmp_path / "windows.jsonl"
    lines = [request_line(0, 600, 5, [1, 2]), request_line(7, 900, 0, [1, 2])]
    trace.write_bytes(("\r\n".join(lines) + "\r\n\r\n").encode("utf-8-sig"))
    records = read_trace(trace)
    assert [(r.line, r.input_length, r.output_length) for r in records] == [(1, 600, 5), (2, 900, 0)]


def test_a_line_separator_inside_a_json_string_does_not_split_a_request(tmp_path):
    # JSON allows U+2028, U+2029 and U+0085 unescaped inside a string, here of a field the format does not know
    trace = tmp_path / "notes.jsonl"
    trace.write_text("\n".join([request_line(0, 100, 3, [1], note="a\u2028b\u2029c\x85d"),
                                request_line(5, 200, 4, [2])]) + "\n", encoding="utf-8")
    assert [(r.line, r.input_length) for r in read_trace(trace)] == [(1, 100), (2, 200)]


def test_json_nested_too_deeply_is_an_error_naming_the_line(tmp_path):
    trace = tmp_path / "deep.jsonl"
    trace.write_text(request_line(0, 100, 3, [1]) + "\n" + "[" * 100_000 + "\n")
    with pytest.raises(TraceError, match=r"deep\.jsonl:2: not JSON \(nested too deeply\)"):
        read_trace(trace)


def test_a_json_array_instead_of_json_lines_is_refused_saying_what_the_format_is(tmp_path):
    trace = tmp_path / "array.json"
    trace.write_text(json.dumps([json.loads(request_line(0, 100, 3, [1]))], indent=1))
    with pytest.raises(TraceError, match=r"array\.json:1: .*one request object per line, not a JSON array"):
        read_trace(trace)


def test_requests_go_out_in_timestamp_order_from_the_earliest_whatever_the_file_order(tmp_path):
    trace = tmp_path / "unsorted.jsonl"
    trace.write_text("\n".join([request_line(500, 10, 1, [1]), request_line(200, 20, 1, [2]),
                                request_line(200, 30, 1, [3])]) + "\n")
    replay = TraceSpec(str(trace)).build()
    assert [r.input_len for r in replay.requests] == [20, 30, 10]  # equal timestamps keep the file's order
    assert replay.arrivals_s == [0.0, 0.0, 0.3]


def test_null_timestamp_and_hash_ids_read_as_missing_ones(tmp_path):
    # the format's writers put null for what they do not know; a null length is still no length
    trace = tmp_path / "nulls.jsonl"
    trace.write_text(json.dumps({"timestamp": None, "input_length": 40, "output_length": 2, "hash_ids": None}) + "\n")
    [record] = read_trace(trace)
    assert (record.timestamp_ms, record.hash_ids, record.input_length) == (0.0, (), 40)
    trace.write_text(json.dumps({"timestamp": 1, "input_length": None, "output_length": 2}) + "\n")
    with pytest.raises(TraceError, match=r"nulls\.jsonl:1: missing field 'input_length' \(null\)"):
        read_trace(trace)


def test_a_large_scale_draws_no_more_of_a_block_than_the_prompts_send(tmp_path):
    # at --context-scale 2000 a hash id stands for 1,024,000 tokens; cut to max_model_len 64 a prompt sends 63 or
    # fewer, and that is all that may be drawn (a block drawn whole is 8 MB of ids, ~1,000 per id of a trace)
    trace = tmp_path / "large.jsonl"
    trace.write_text("\n".join([request_line(0, 600, 50_000, [1, 2]), request_line(1, 900, 1, [1, 3])]) + "\n")
    spec = TraceSpec(str(trace), vocab_size=1000, context_scale=2000, output_scale=1 / 1000, max_model_len=64)
    tracemalloc.start()
    try:
        cut, longer = spec.build().requests
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # 4 MB: reading the file takes 1 MB; one block drawn whole alone would be over 8 MB
    assert spec.block_tokens == 1_024_000 and peak < 4_000_000, f"{peak:,} bytes drawn for prompts of 63 tokens"
    # the same tokens as the block drawn whole: the second prompt goes on drawing the block where the first stopped
    whole = random.Random("kvshard-trace:0:1").choices(range(1000), k=63)
    assert (cut.input_len, cut.output_len, longer.input_len) == (14, 50, 63)
    assert cut.prompt_token_ids == whole[:14] and longer.prompt_token_ids == whole


def test_a_trace_request_longer_than_any_context_window_is_refused_before_a_token_is_drawn(tmp_path):
    # bench dcp and throughput size max_model_len by the requests: without one to cut to, the ceiling refuses
    trace = tmp_path / "huge.jsonl"
    trace.write_text(request_line(0, 10, 1, []) + "\n" + request_line(5, 10, MAX_REQUEST_TOKENS, []) + "\n")
    with pytest.raises(TraceError, match=r"huge\.jsonl:2: .* more than any model's context window .*--max-model-len"):
        TraceSpec(str(trace)).build()
    assert [r.output_len for r in TraceSpec(str(trace), max_model_len=4096).build().requests] == [1, 4095]


@pytest.mark.parametrize("scale", [1e-300, 1 / 3e299, 1e-9])
def test_a_tiny_scale_is_described_without_a_huge_fraction_or_a_backward_range(scale):
    for described in (WorkloadSpec("agentic", context_scale=scale).describe(),
                      WorkloadSpec("sessions", context_scale=scale).describe(),
                      TraceSpec("t.jsonl", context_scale=scale).describe()):
        assert f"x{scale:g}" in described and len(described) < 300, described
        for low, high in re.findall(r"(\d[\d,]*)-(\d[\d,]*)", described):
            assert int(high.replace(",", "")) > int(low.replace(",", "")), described
    assert "x1/1024:" in WorkloadSpec("agentic", context_scale=1 / 1024).describe()  # a simple fraction stays one


def test_conversations_of_million_token_requests_are_found_in_time_linear_in_their_ids():
    # 300 requests of 2,048 ids (1M tokens each) that extend nothing: every prefix of each is looked up
    records = [TraceRecord(i + 1, float(i), 2048 * 512, 1, tuple(range(i * 2048, (i + 1) * 2048)))
               for i in range(300)]
    start = time.process_time()
    grouped = conversations(records)
    seconds = time.process_time() - start
    assert len(grouped) == 300
    assert seconds < 2.5, f"{seconds:.1f} s of CPU time: the prefixes cost their length each"


# --- bench serve against a server that answers oddly ----------------------------------------------

class _OddServer(BaseHTTPRequestHandler):
    models_body = '{"data": []}'

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        body = self.models_body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def odd_server():
    """A server whose /v1/models says what `_OddServer.models_body` holds."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OddServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    _OddServer.models_body = '{"data": []}'


@pytest.mark.parametrize("models_body, message", [
    ('{"data": []}', "names no model in /v1/models: pass --model"),
    ('{"data": {"id": "m"}}', "without a list of models"),
    ('[1, 2]', "cannot list the models"),
])
def test_a_server_that_lists_no_model_is_a_benchmark_error(odd_server, models_body, message):
    _OddServer.models_body = models_body
    with pytest.raises(BenchmarkError, match=message):
        probe(odd_server, None, None)


def _stream(body: str):
    """The outcome of one request whose server streams `body`."""
    async def run():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, "http://server/v1/completions", "m", BenchRequest([1, 2, 3], 2), {})

    return asyncio.run(run())


@pytest.mark.parametrize("event, error", [
    ('{"error": "overloaded"}', "overloaded"),  # a bare string, not vLLM's {"message": ...}
    ('[1, 2]', "not a JSON object"),
])
def test_an_error_event_of_any_shape_fails_its_request_with_the_servers_words(event, error):
    outcome = _stream(f"data: {event}\n\ndata: [DONE]\n\n")
    assert not outcome.success and error in outcome.error


def test_usage_without_completion_tokens_counts_the_chunks():
    chunk = 'data: {"choices": [{"text": "x"}]}\n\n'
    outcome = _stream(chunk * 2 + 'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\ndata: [DONE]\n\n')
    assert outcome.success and outcome.output_len == 2


@pytest.mark.parametrize("usage", [
    {"completion_tokens": "7", "prompt_tokens_details": {"cached_tokens": "all"}},
    {"completion_tokens": None, "prompt_tokens_details": ["not", "an", "object"]},
    {"completion_tokens": 2.5}, {"completion_tokens": -1}, {"completion_tokens": True},
])
def test_a_usage_count_that_is_not_a_count_is_taken_as_missing(usage):
    chunk = 'data: {"choices": [{"text": "x"}]}\n\n'
    outcome = _stream(chunk * 2 + f'data: {json.dumps({"choices": [], "usage": usage})}\n\ndata: [DONE]\n\n')
    assert outcome.success and outcome.output_len == 2 and outcome.cached_tokens is None
    outcome.latency = 1.0
    result = summarize([outcome], 1.0, 1)  # the sums of the summary take it
    assert result["total_output_tokens"] == 2 and result["total_cached_tokens"] is None


# --- bench flags ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [("--context-scale", "inf"), ("--context-scale", "nan"),
                                         ("--output-scale", "inf"), ("--metrics-interval", "0")])
def test_a_scale_or_interval_that_is_not_a_positive_number_is_refused_by_the_parser(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_main(["serve", "--base-url", f"http://127.0.0.1:{refused_port()}", "--workload", "agentic",
                    "--vocab-size", "10", "--num-prompts", "1", f"{flag}={value}"])
    assert exit_.value.code == 2 and "positive number" in capsys.readouterr().err


def test_a_request_rate_with_recorded_arrival_times_is_refused(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(request_line(0, 10, 1, [1]) + "\n")
    dead = f"http://127.0.0.1:{refused_port()}"  # reached only if the check is missing: exit 1, not 2
    assert bench_main(["serve", "--base-url", dead, "--workload", "trace", "--trace", str(trace), "--vocab-size",
                       "10", "--request-rate", "5"]) == 2
    assert "--request-rate 5 does not apply to --trace-timing timestamps" in capsys.readouterr().err


def test_a_scale_that_would_draw_absurd_prompts_is_refused_before_a_token_is_drawn(monkeypatch, capsys):
    import kvshard.bench.throughput as throughput

    with pytest.raises(ValueError, match="up to 1,050,176,000 tokens .* more than any model's context window"):
        WorkloadSpec("agentic", context_scale=1000)  # prompts of up to a billion token ids each
    monkeypatch.setattr(WorkloadSpec, "requests", must_not_start)
    monkeypatch.setattr(WorkloadSpec, "sessions", must_not_start)
    monkeypatch.setattr(throughput, "run_kvshard", must_not_start)
    assert bench_main(["throughput", MODEL, "--workload", "agentic", "--context-scale", "1000", "--vocab-size",
                       "10", "--num-prompts", "1"]) == 2
    assert "more than any model's context window (16,777,216)" in capsys.readouterr().err


def test_bench_serve_refuses_a_workload_longer_than_the_servers_max_model_len(odd_server, monkeypatch, capsys):
    _OddServer.models_body = '{"data": [{"id": "m", "max_model_len": 4096}]}'
    monkeypatch.setattr(WorkloadSpec, "sessions", must_not_start)
    assert bench_main(["serve", "--base-url", odd_server, "--workload", "agentic", "--context-scale", "1/64",
                       "--vocab-size", "10", "--num-prompts", "1", "--no-progress"]) == 2
    assert "up to 16,409 tokens (prompt + output), more than the server's max_model_len (4,096)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_bench_serve_stopped_early_keeps_the_requests_that_finished(stop, tmp_path, monkeypatch, capsys):
    import kvshard.bench.serve as serve

    sent, ignored = [], []

    async def send(client, url, model, request, headers, extra_body=None):
        sent.append(request)
        if len(sent) == 2:  # Ctrl-C, or a kill, while the second request is in flight: it never finishes
            signal.raise_signal(stop)
            await asyncio.sleep(5)
        return RequestOutcome(request.input_len, success=True, output_len=request.output_len, ttft=0.01,
                              latency=0.02)

    monkeypatch.setattr(serve, "probe", lambda base_url, model, api_key: "m")
    monkeypatch.setattr(serve, "send_request", send)
    # a SIGTERM the benchmark does not take as an interrupt is noted here, not a kill of the test run; Ctrl-C as
    # in a terminal, whatever the test process was left with
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: ignored.append(signum))
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = bench_main(["serve", "--base-url", f"http://127.0.0.1:{refused_port()}", "--vocab-size", "10",
                           "--max-model-len", "100", "--input-len", "8", "--output-len", "2", "--num-prompts", "3",
                           "--max-concurrency", "1", "--no-progress", "--result-file", str(tmp_path / "r.json")])
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    out, err = capsys.readouterr()
    assert code == 130 and "kvshard bench: interrupted" in err and not ignored
    assert not (tmp_path / "r.json").exists()  # a partial run is not the result (nor overwrites an earlier one)
    saved = json.loads((tmp_path / "r-interrupted.json").read_text())
    assert saved["interrupted"] and (saved["completed"], saved["failed"], saved["unfinished_requests"]) == (1, 0, 2)
    assert saved["num_prompts"] == 3 and saved["total_output_tokens"] == 2 and saved["workload"].startswith("random")
    assert "the 1 of 3 requests that finished are in" in out


def test_an_unwritable_result_file_is_refused_before_the_run(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    dead = f"http://127.0.0.1:{refused_port()}"  # reached only if the check is missing: exit 1, not 2
    for result_file, message in [(tmp_path / "a-file" / "r.json", "cannot write in"),
                                 (tmp_path, "is a directory")]:
        assert bench_main(["serve", "--base-url", dead, "--vocab-size", "10", "--num-prompts", "1",
                           "--result-file", str(result_file)]) == 2
        assert message in capsys.readouterr().err


def test_an_unwritable_output_dir_of_bench_dcp_is_refused_before_any_server(tmp_path, monkeypatch, capsys):
    import kvshard.bench.dcp as dcp

    monkeypatch.setattr(dcp, "run_dcp_experiment", must_not_start)
    (tmp_path / "a-file").write_text("")
    assert bench_main(["dcp", MODEL, "--output-dir", str(tmp_path / "a-file" / "out"), "--vocab-size", "10",
                       "--workload", "random", "--input-len", "8", "--output-len", "2", "--concurrency", "1",
                       "--sweep-limit", "0"]) == 2
    assert "--output-dir: cannot write in" in capsys.readouterr().err


def test_bench_dcp_stopped_early_keeps_the_points_it_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(ServerProcess, "start", lambda self: None)  # no server: the points are made up below
    monkeypatch.setattr(ServerProcess, "stop", lambda self: None)
    calls = []

    def run_next(self, sessions, log):
        calls.append(self.label)
        if len(calls) == 3:
            raise KeyboardInterrupt
        self.points.append({"concurrency": self.concurrencies.pop(0), "output_throughput_per_rank": 1.0})

    monkeypatch.setattr(_Sweep, "run_next", run_next)
    experiment = DCPExperiment(model=MODEL, tp=2, dcps=[2], concurrencies=[1, 2],
                               workload=WorkloadSpec("random", vocab_size=10, input_len=4, output_len=2),
                               kv_cache_memory="1MiB", max_num_seqs=8, output_dir=tmp_path, progress=False)
    logged = []
    with pytest.raises(KeyboardInterrupt):
        run_dcp_experiment(experiment, log=logged.append)
    saved = json.loads((tmp_path / "dcp-interrupted.json").read_text())
    assert saved["interrupted"] and [(c["label"], len(c["points"])) for c in saved["configs"]] == [
        ("TP=2", 1), ("TP=2 + DCP=2", 1)]
    assert any("2 points measured so far" in line for line in logged)


def test_decode_floor_refuses_an_empty_batch_before_the_engine_starts(monkeypatch, capsys):
    import kvshard.bench.decode_floor as decode_floor

    monkeypatch.setattr(kvshard, "LLM", must_not_start)
    monkeypatch.setattr(decode_floor, "copy_bandwidth", must_not_start)
    assert bench_main(["decode-floor", MODEL, "--batch-size", "0"]) == 2
    assert "--batch-size, --context-len and --steps must be at least 1" in capsys.readouterr().err


def test_throughput_refuses_zero_prompts_before_the_engine_starts(monkeypatch, capsys):
    import kvshard.bench.throughput as throughput

    monkeypatch.setattr(throughput, "run_kvshard", must_not_start)
    assert bench_main(["throughput", MODEL, "--num-prompts", "0", "--vocab-size", "10"]) == 2
    assert "--num-prompts must be at least 1" in capsys.readouterr().err


def test_throughput_of_vllm_without_vllm_installed_says_where_to_run_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as without it, installed here or not
    assert bench_main(["throughput", MODEL, "--engine", "vllm", "--vocab-size", "10", "--num-prompts", "1",
                       "--no-progress"]) == 1
    assert "--engine vllm needs vLLM in this Python" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [(["--requests", "0"], "must be at least 1"),
                                           (["--steps", "0"], "must be at least 1"),
                                           (["--contexts", "1K"], "not a comma-separated list of integers")])
def test_host_step_refuses_what_it_cannot_measure_with_a_usage_error(argv, message, capsys):
    from kvshard.bench.host_step import main as host_step_main

    with pytest.raises(SystemExit) as exit_:
        host_step_main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err

def test_generate_checks_its_sampling_flags_before_the_engine_starts(monkeypatch, capsys):
    monkeypatch.setattr(kvshard, "LLM", must_not_start)
    assert kvshard_main(["generate", MODEL, "--max-tokens", "0"]) == 2
    assert "max_tokens must be an integer >= 1" in capsys.readouterr().err
    # and an empty prompt (it was refused once the engine had loaded the model)
    assert kvshard_main(["generate", MODEL, "--prompt", "Hi", "--prompt", ""]) == 2
    assert "--prompt is empty" in capsys.readouterr().err


# --- kvshard plan -----------------------------------------------------------------------------------

PLAN = ["--model", "llama-3.1-70b", "--gpu", "H200", "--gpus", "8", "--workload", "agentic"]


def _one_line_error(argv: list[str], capsys) -> str:
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvshard plan: error: "), err
    return err


@pytest.mark.parametrize("extra", [["--hbm-tbps", "nan"], ["--hbm-gib", "inf"], ["--nvlink-gbps", "inf"],
                                   ["--kv-memory-gib", "nan"], ["--reserve-gib", "nan"],
                                   ["--collective-latency-us", "inf"]])
def test_a_figure_that_is_not_a_finite_number_is_a_one_line_error(extra, capsys):
    _one_line_error([*PLAN, *extra], capsys)


def test_a_reserve_above_what_the_gpu_gives_is_said_so(capsys):
    assert "--reserve-gib 1000 leaves nothing of the 126.9 GiB a H200" in _one_line_error(
        [*PLAN, "--reserve-gib", "1000"], capsys)


@pytest.mark.parametrize("content, message", [
    (b"[1, 2]", "holds a JSON list, not an object"),
    (b"\xff\xfe{}", "cannot read"),
    (json.dumps({"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 0, "vocab_size": 10}).encode(),
     "'num_attention_heads' must be a positive integer, got 0"),
    (json.dumps({"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "vocab_size": 10,
                 "num_key_value_heads": "two"}).encode(), "has the wrong type"),
])
def test_a_config_json_the_planner_cannot_read_is_a_one_line_error(tmp_path, content, message, capsys):
    (tmp_path / "config.json").write_bytes(content)
    assert message in _one_line_error(["--model", str(tmp_path), *PLAN[2:]], capsys)



class _KeepAliveServer(BaseHTTPRequestHandler):
    """Streams two chunks and [DONE] in chunked transfer encoding, the body's end a moment after [DONE] (as a server's
    last write lands); counts the connections it accepted."""
    protocol_version = "HTTP/1.1"
    connections = 0

    def log_message(self, *args) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        type(self).connections += 1

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in ('{"choices": [{"text": "a"}]}', '{"choices": [{"text": "b"}]}', "[DONE]"):
            data = f"data: {event}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        time.sleep(0.02)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def test_bench_requests_reuse_their_connections():
    """Before: the client stopped reading at [DONE], before the body's end, and httpx closed such a connection: every
    request of a benchmark paid a new TCP connection (and the server its set-up), some 12% of the client's time."""
    _KeepAliveServer.connections = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KeepAliveServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"

    async def run():
        async with httpx.AsyncClient() as client:
            return [await send_request(client, url, "m", BenchRequest([1, 2, 3], 2), {}) for _ in range(5)]

    try:
        outcomes = asyncio.run(run())
    finally:
        server.shutdown()
        server.server_close()
    assert all(o.success and o.output_len == 2 for o in outcomes), [o.error for o in outcomes]
    assert _KeepAliveServer.connections == 1
