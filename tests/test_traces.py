"""Mooncake-format traces: reading, token blocks per hash id, scaling, windows, conversations, and a replay
through a real `kvshard serve` whose prefix cache must see the trace's reuse.

No timing is asserted (the machine may be shared).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshard.bench.cli import main as bench_main
from kvshard.bench.cli import model_vocab_size
from kvshard.bench.dcp import KV_FULL, saturated
from kvshard.bench.serve import request_list_digest
from kvshard.bench.traces import TraceError, TraceSpec, conversations, read_trace

from server_harness import MODEL, Server

SYNTHETIC_TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_synthetic_trace.jsonl"


def write_trace(path: Path, records: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def record(t: int, input_length: int, output_length: int, ids: list[int], **extra) -> dict:
    return {"timestamp": t, "input_length": input_length, "output_length": output_length, "hash_ids": ids, **extra}


@pytest.fixture
def shared_prefix_trace(tmp_path):
    # requests 1 and 2 share 3 ids, 1 and 3 share 1, 4 shares none
    return write_trace(tmp_path / "t.jsonl", [
        record(0, 5 * 512, 10, [0, 1, 2, 3, 4]),
        record(100, 4 * 512 - 7, 20, [0, 1, 2, 9]),
        record(250, 2 * 512, 30, [0, 7]),
        record(900, 512, 40, [11], note="unknown fields are ignored"),
    ])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("scale, block", [(1.0, 512), (1 / 16, 32), (1 / 512, 1), (1 / 3, 171)])
def test_requests_sharing_k_ids_share_exactly_k_blocks_of_leading_tokens(shared_prefix_trace, scale, block):
    spec = TraceSpec(str(shared_prefix_trace), vocab_size=1000, seed=3, context_scale=scale)
    assert spec.block_tokens == block
    first, second, third, fourth = spec.build().requests
    assert _common_prefix(first.prompt_token_ids, second.prompt_token_ids) == 3 * block
    assert _common_prefix(first.prompt_token_ids, third.prompt_token_ids) == 1 * block
    assert _common_prefix(first.prompt_token_ids, fourth.prompt_token_ids) < block  # chance agreement only
    # a prompt is its blocks cut to its (scaled) input length; outputs scale with the context by default
    assert [r.input_len for r in (first, second, third, fourth)] == [
        max(1, round(n * scale)) for n in (5 * 512, 4 * 512 - 7, 2 * 512, 512)]
    assert [r.output_len for r in (first, second)] == [max(1, round(10 * scale)), max(1, round(20 * scale))]
    assert all(0 <= t < 1000 for r in (first, second, third, fourth) for t in r.prompt_token_ids)


def test_a_prompt_longer_than_its_blocks_is_padded_with_tokens_of_its_own(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [record(0, 40, 4, [5]), record(1, 40, 4, [5])])
    a, b = TraceSpec(str(trace), context_scale=1 / 32).build().requests  # blocks of 16 tokens
    assert a.input_len == b.input_len == 1 and a.prompt_token_ids == b.prompt_token_ids  # round(40/32)=1
    a, b = TraceSpec(str(trace), context_scale=1 / 2).build().requests  # 20 tokens, blocks of 256
    assert a.prompt_token_ids == b.prompt_token_ids and a.input_len == 20
    long_a, long_b = TraceSpec(str(write_trace(tmp_path / "u.jsonl", [record(0, 700, 4, [5]), record(1, 700, 4, [5])]))
                               ).build().requests
    assert _common_prefix(long_a.prompt_token_ids, long_b.prompt_token_ids) == 512 and long_a.input_len == 700


def test_same_file_and_seed_give_the_same_digest_and_another_seed_does_not(shared_prefix_trace):
    def digest(seed: int) -> str:
        replay = TraceSpec(str(shared_prefix_trace), vocab_size=500, seed=seed, context_scale=1 / 8).build()
        return request_list_digest(replay.requests)

    assert digest(0) == digest(0)
    assert digest(0) != digest(1)
    info = TraceSpec(str(shared_prefix_trace)).build().info
    assert len(info["sha256"]) == 64 and info["file_requests"] == 4 and info["num_requests"] == 4


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"timestamp": 0, "output_length": 3, "hash_ids": []}', "missing field 'input_length'"),
    ('{"timestamp": 0, "input_length": 3, "hash_ids": []}', "missing field 'output_length'"),
    ('{"timestamp": 0, "input_length": "12", "output_length": 3, "hash_ids": []}', "'input_length' must be a number"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 3, "hash_ids": []}', "'input_length' must be at least 1"),
    ('{"timestamp": 0, "input_length": 2.5, "output_length": 3, "hash_ids": []}', "must be an integer"),
    ('{"timestamp": 0, "input_length": 4, "output_length": 3, "hash_ids": [1, "x"]}', "'hash_ids' must be a list"),
    ('{"timestamp": NaN, "input_length": 4, "output_length": 3, "hash_ids": [1]}', "'timestamp' must be a number"),
    ('{"timestamp": 0, "input_length": 1%s, "output_length": 3}' % ("0" * 400), "'input_length' is out of range"),
    ('{"timestamp": 1%s, "input_length": 4, "output_length": 3}' % ("0" * 400), "'timestamp' is out of range"),
    ('{"timestamp": 0, "input_length": 1%s, "output_length": 3}' % ("0" * 5000), "not a readable JSON value"),
])
def test_a_malformed_line_fails_naming_its_line(tmp_path, line, message):
    trace = write_trace(tmp_path / "bad.jsonl", [record(0, 10, 1, [0]), "", line])
    with pytest.raises(TraceError, match=rf"bad\.jsonl:3: .*{message}"):
        read_trace(trace)


def test_a_file_that_is_not_utf8_text_names_its_line_or_says_to_decompress(tmp_path):
    trace = tmp_path / "latin1.jsonl"
    trace.write_bytes(json.dumps(record(0, 10, 1, [0])).encode() + b"\r\n"
                      + json.dumps(record(1, 10, 1, [1])).encode() + b"\n"
                      + b'{"timestamp": 2, "input_length": 4, "output_length": 1, "note": "caf\xe9"}\n')
    with pytest.raises(TraceError, match=r"latin1\.jsonl:3: not UTF-8 text"):
        read_trace(trace)
    import gzip
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(json.dumps(record(0, 10, 1, [0])).encode()))
    with pytest.raises(TraceError, match="gzip-compressed file: decompress it first"):
        read_trace(packed)


def test_a_missing_or_empty_trace_is_a_clear_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read the trace"):
        read_trace(tmp_path / "absent.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(write_trace(tmp_path / "empty.jsonl", ["", " "]))


def test_window_cut_to_max_model_len_and_arrivals(shared_prefix_trace):
    replay = TraceSpec(str(shared_prefix_trace), skip=1, num_requests=2, max_model_len=1000).build()
    # lines 2 and 3: 2,041 and 1,024 prompt tokens do not fit 1,000 with their outputs
    assert [r.input_len + r.output_len for r in replay.requests] == [1000, 1000]
    assert [r.output_len for r in replay.requests] == [20, 30]
    assert replay.info["cut_prompts"] == 2 and replay.info["cut_outputs"] == 0
    assert (replay.info["first_line"], replay.info["last_line"]) == (2, 3)
    assert replay.arrivals_s == [0.0, 0.15]  # from the window's first request
    with pytest.raises(TraceError, match="leaves no request"):
        TraceSpec(str(shared_prefix_trace), skip=4).build()


def test_conversations_join_requests_that_extend_a_latest_turn(tmp_path):
    trace = write_trace(tmp_path / "c.jsonl", [
        record(0, 1100, 5, [0, 1, 2]),  # conversation A, turn 1 (its last block partial)
        record(1, 600, 5, [50, 51]),  # B, one turn only
        record(2, 1400, 5, [0, 1, 3]),  # A, turn 2: all ids of turn 1 but its partial last block
        record(3, 1100, 5, [0, 1, 2]),  # the same prompt as A's turn 1, not longer than A's latest: a new one
        record(4, 2000, 5, [0, 1, 3, 4]),  # A, turn 3: extends turn 2 whole
        record(5, 1600, 5, [0, 1, 2, 8]),  # extends the request of line 4 (C), not A's old turn 1
    ])
    grouped = [[r.line for r in c] for c in conversations(read_trace(trace))]
    assert grouped == [[1, 3, 5], [2], [4, 6]]
    replay = TraceSpec(str(trace), conversations=2, context_scale=1 / 4).build()
    assert [len(s) for s in replay.sessions] == [3, 2] and replay.info["lines"] == [[1, 3, 5], [4, 6]]
    assert replay.arrivals_s == [0.0, 0.003]
    turns = replay.sessions[0]
    assert _common_prefix(turns[0].prompt_token_ids, turns[1].prompt_token_ids) == 2 * 128
    # turn 2 (350 tokens: blocks 0 and 1, then 94 of block 3) is all inside turn 3
    assert _common_prefix(turns[1].prompt_token_ids, turns[2].prompt_token_ids) == turns[1].input_len == 350
    capped = TraceSpec(str(trace), conversations=1, max_turns=2).build()
    assert [len(s) for s in capped.sessions] == [2]
    with pytest.raises(TraceError, match="2 multi-turn conversations .* fewer than --trace-conversations 3"):
        TraceSpec(str(trace), conversations=3).build()


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_conversations_are_grouped_in_time_order_whatever_the_file_order(tmp_path, order):
    """A file need not be sorted by time (one logged as requests finished is not): the replay groups turns as they
    arrived, so a reordered file gives the same conversations, each sent in time order."""
    import random

    lines = SYNTHETIC_TRACE.read_text().splitlines()[:800]
    shuffled = lines[::-1] if order == "reversed" else random.Random(3).sample(lines, len(lines))
    trace = write_trace(tmp_path / "reordered.jsonl", shuffled)
    spec = dict(context_scale=1 / 16, conversations=16, max_model_len=4096)
    want = TraceSpec(str(write_trace(tmp_path / "sorted.jsonl", lines)), **spec).build()
    got = TraceSpec(str(trace), **spec).build()
    assert [[r.prompt_token_ids for r in s] for s in got.sessions] == \
        [[r.prompt_token_ids for r in s] for s in want.sessions]
    assert got.arrivals_s == want.arrivals_s


def test_the_synthetic_trace_reads_with_its_reuse():
    records = read_trace(SYNTHETIC_TRACE)
    assert len(records) == 3993
    multi = [c for c in conversations(records) if len(c) > 1]
    assert len(multi) > 100 and max(len(c) for c in multi) >= 4
    replay = TraceSpec(str(SYNTHETIC_TRACE), context_scale=1 / 16, conversations=16, max_model_len=4096).build()
    assert replay.info["num_sessions"] == 16 and all(len(s) >= 2 for s in replay.sessions)
    for session in replay.sessions:  # each turn repeats its predecessor's full blocks
        for before, after in zip(session, session[1:]):
            shared = _common_prefix(before.prompt_token_ids, after.prompt_token_ids)
            assert shared >= (before.input_len // 32 - 1) * 32


def test_a_bad_trace_setting_is_refused():
    for kwargs, message in [({"context_scale": 0}, "context-scale"), ({"skip": -1}, "trace-skip"),
                            ({"conversations": 0}, "trace-conversations"), ({"timing": "poisson"}, "trace-timing"),
                            ({"time_scale": 0}, "time-scale"), ({"max_turns": 1}, "trace-max-turns")]:
        with pytest.raises(ValueError, match=message):
            TraceSpec("x.jsonl", **kwargs)


def test_trace_flags_that_would_be_ignored_and_a_bad_file_are_refused_before_the_server_is_asked(tmp_path, capsys):
    """No server listens at the URL: each refusal is the command line's or the file's, not "connection refused"."""
    bad = write_trace(tmp_path / "bad.jsonl", [record(0, 10, 1, [0]), "oops"])
    nowhere = ["serve", "--base-url", "http://127.0.0.1:9", "--no-progress"]
    for argv, message in [
        ([*nowhere, "--trace", str(bad)], "--trace is for a trace replay: add --workload trace (the workload is random)"),
        ([*nowhere, "--trace-skip", "2", "--trace-conversations", "3"],
         "--trace-skip, --trace-conversations are for a trace replay"),
        ([*nowhere, "--workload", "trace", "--trace", str(bad)], r"bad.jsonl:2: not JSON"),
        ([*nowhere, "--workload", "trace", "--trace", str(bad), "--trace-max-turns", "2"],
         "--trace-max-turns caps the turns of --trace-conversations: give both"),
    ]:
        assert bench_main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv


def _point(throughput: float, kv: float, preemptions: int = 0) -> dict:
    return {"output_throughput_per_rank": throughput,
            "server": {"peak_kv_usage": kv, "preemptions": preemptions}}


def test_a_layout_is_saturated_once_its_kv_is_capped_and_throughput_stops_rising():
    assert not saturated([_point(10, 0.99)])  # one point shows no trend
    assert not saturated([_point(10, 0.5), _point(12, 0.7)])  # KV not capped
    assert not saturated([_point(10, 0.8), _point(13, KV_FULL)])  # still rising by 30%
    assert saturated([_point(10, 0.8), _point(10.4, KV_FULL)])
    assert saturated([_point(10, 0.8), _point(12, 0.5), _point(11, 0.6, preemptions=3)])


# --- through a real server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server([MODEL, "--max-model-len", "512", "--kv-cache-memory", "16MiB"],
                    tmp_path_factory.mktemp("trace-server") / "server.log")
    yield server
    server.stop()


def test_a_two_turn_conversation_finds_its_first_turn_cached(server, tmp_path, capsys):
    # scale 1/16: trace blocks of 32 tokens, two of kvshard's 16-token blocks each
    trace = write_trace(tmp_path / "conv.jsonl", [
        record(0, 3 * 512, 64, [10, 11, 12]),  # turn 1: 96 tokens
        record(40, 3 * 512, 64, [20, 21, 22]),  # another one-turn request
        record(80, 5 * 512 - 100, 64, [10, 11, 12, 13, 14]),  # turn 2: 154 tokens, the first 96 turn 1's
    ])
    out_file = tmp_path / "result.json"
    code = bench_main(["serve", "--base-url", server.url, "--workload", "trace", "--trace", str(trace),
                       "--context-scale", "1/16", "--trace-conversations", "1", "--time-scale", "100",
                       "--result-file", str(out_file), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out_file.read_text())
    assert result["completed"] == 2 and result["failed"] == 0
    first, second = result["turns"]
    assert first["mean_input_len"] == 96 and second["mean_input_len"] == 154
    assert first["mean_cached_tokens"] == 0
    assert second["mean_cached_tokens"] == 96  # all of turn 1's blocks, from kvshard's prefix cache
    assert result["trace"]["lines"] == [[1, 3]] and result["trace"]["sha256"]
    assert result["total_output_tokens"] == 8 and "p90_ttft_ms" in result
    assert "Turn 2 (1): prompt/cached" in out


def test_a_replay_at_recorded_times_and_a_closed_loop_send_the_same_requests(server, shared_prefix_trace, tmp_path,
                                                                            capsys):
    vocab = model_vocab_size(MODEL)
    digests = []
    for timing in (["--trace-timing", "timestamps", "--time-scale", "10"],
                   ["--trace-timing", "closed", "--max-concurrency", "2"]):
        out_file = tmp_path / f"{timing[1]}.json"
        code = bench_main(["serve", "--base-url", server.url, "--workload", "trace", "--trace",
                           str(shared_prefix_trace), "--context-scale", "1/16", *timing,
                           "--result-file", str(out_file), "--no-progress"])
        assert code == 0, capsys.readouterr().out
        result = json.loads(out_file.read_text())
        assert result["completed"] == 4 and result["request_rate"] == ("trace" if timing[1] == "timestamps"
                                                                       else "inf")
        digests.append(result["trace"]["requests_digest"])
    expected = TraceSpec(str(shared_prefix_trace), vocab_size=vocab, context_scale=1 / 16).build()
    assert digests == [request_list_digest(expected.requests)] * 2
    # the server's limit cuts the prompts: max_model_len 512 from /v1/models
    code = bench_main(["serve", "--base-url", server.url, "--workload", "trace", "--trace", str(shared_prefix_trace),
                       "--context-scale", "1/2", "--trace-timing", "closed", "--max-concurrency", "4",
                       "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and "cut to fit the server's max_model_len 512: 3 prompts, 0 outputs" in out, out


def test_closed_timing_needs_a_concurrency_and_a_trace_needs_a_path(server, shared_prefix_trace, capsys):
    assert bench_main(["serve", "--base-url", server.url, "--workload", "trace", "--trace", str(shared_prefix_trace),
                       "--trace-timing", "closed"]) == 2
    assert "needs --max-concurrency" in capsys.readouterr().err
    assert bench_main(["serve", "--base-url", server.url, "--workload", "trace"]) == 2
    assert "needs --trace PATH" in capsys.readouterr().err


def test_bench_dcp_replays_a_trace_as_its_sweep_and_bench_throughput_reads_one(shared_prefix_trace, tmp_path,
                                                                               monkeypatch, capsys):
    import kvshard.bench.dcp as dcp
    import kvshard.bench.throughput as throughput

    seen = {}

    def fake_experiment(experiment):  # the servers are the tiny dcp test's (test_bench.py); here the wiring
        seen["experiment"] = experiment
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp, "run_dcp_experiment", fake_experiment)
    # its requests share prefixes but none extends another: no conversation to replay, said before any server
    assert bench_main(["dcp", MODEL, "--workload", "trace", "--trace", str(shared_prefix_trace), "--context-scale",
                       "1/8", "--trace-conversations", "1", "--output-dir", str(tmp_path)]) == 2
    assert "0 multi-turn conversations" in capsys.readouterr().err and "experiment" not in seen
    code = bench_main(["dcp", MODEL, "--workload", "trace", "--trace", str(shared_prefix_trace),
                       "--context-scale", "1/8", "--output-scale", "1/8", "--concurrency", "1,2",
                       "--output-dir", str(tmp_path)])
    assert code == 130
    experiment = seen["experiment"]
    expected = TraceSpec(str(shared_prefix_trace), vocab_size=model_vocab_size(MODEL), context_scale=1 / 8).build()
    assert experiment.sessions == expected.sessions and experiment.all_sessions() == expected.sessions
    assert "trace t.jsonl" in experiment.workload_description and "closed loop" in experiment.workload_description
    # --max-model-len defaults to the longest request of the replay
    flags = experiment.server_flags
    assert flags[flags.index("--max-model-len") + 1] == str(max(r.input_len + r.output_len for r in expected.requests))

    def fake_run(engine_args, requests, repeats, progress):
        seen["requests"] = requests
        return [1.0], sum(r.output_len for r in requests), {}

    monkeypatch.setattr(throughput, "run_kvshard", fake_run)
    out_file = tmp_path / "throughput.json"
    assert bench_main(["throughput", MODEL, "--workload", "trace", "--trace", str(shared_prefix_trace),
                       "--context-scale", "1/8", "--num-prompts", "3", "--result-file", str(out_file)]) == 0
    assert seen["requests"] == expected.requests[:3]
    result = json.loads(out_file.read_text())
    assert result["trace"]["num_requests"] == 3 and result["requests_digest"] == request_list_digest(
        expected.requests[:3])


def test_event_stream_lines_split_at_line_feeds_only():
    import asyncio

    from kvshard.bench.serve import sse_lines

    async def chunks():
        for part in ['data: {"text": "a\u2028b\x85c\x1c"}\r\n', '\ndata: {"t', 'ext": "d"}\n\n', "data: [DONE]"]:
            yield part

    async def collect():
        return [line async for line in sse_lines(chunks())]

    assert asyncio.run(collect()) == ['data: {"text": "a\u2028b\x85c\x1c"}', "", 'data: {"text": "d"}', "",
                                      "data: [DONE]"]
