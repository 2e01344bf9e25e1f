"""The tools around the server: unusual but valid Mooncake traces, malformed ones, a server that answers oddly,
outputs that cannot be written, a `bench dcp` that stops early, and planner inputs no plan can come from.

No engine or server starts here: where a command would start one, it is replaced by a stand-in that fails the
test, so each case shows the mistake is caught before anything slow runs.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

import kvshard
from kvshard.bench.cli import main as bench_main
from kvshard.bench.dcp import DCPExperiment, _Sweep, run_dcp_experiment
from kvshard.bench.serve import BenchmarkError, probe, send_request
from kvshard.bench.server import ServerProcess
from kvshard.bench.traces import TraceError, TraceRecord, TraceSpec, conversations, read_trace
from kvshard.bench.workloads import BenchRequest, WorkloadSpec
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


# --- bench flags ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [("--context-scale", "inf"), ("--context-scale", "nan"),
                                         ("--output-scale", "inf"), ("--metrics-interval", "0")])
def test_a_scale_or_interval_that_is_not_a_positive_number_is_refused_by_the_parser(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_main(["serve", "--base-url", f"http://127.0.0.1:{refused_port()}", "--workload", "agentic",
                    "--vocab-size", "10", "--num-prompts", "1", f"{flag}={value}"])
    assert exit_.value.code == 2 and "positive number" in capsys.readouterr().err


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


def test_throughput_of_vllm_without_vllm_installed_says_where_to_run_it(capsys):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
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

