"""Benchmarks: the workload generator's distributions, /metrics scraping, and a tiny `bench dcp` run.

No timing is asserted here (the machine may be shared); the measured numbers live
in BENCHMARKS.md with the commands that produced them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvshard.bench.cli import main as bench_main
from kvshard.bench.cli import model_vocab_size
from kvshard.bench.metrics import MetricsTrace, ServerSnapshot, parse_metrics
from kvshard.bench.serve import RequestOutcome, summarize
from kvshard.bench.server import ServerProcess, ServerStartError
from kvshard.bench.workloads import (
    AGENTIC_LONG_FRACTION, AGENTIC_LONG_RANGE, AGENTIC_OUTPUT_MEDIAN, AGENTIC_SHORT_RANGE, SESSION_NEW_INPUT_RANGE,
    WorkloadSpec,
)
from kvshard.entrypoints.cli import build_parser

# --- workloads ---------------------------------------------------------------------------

SCALE = 1 / 1024  # long inputs 64..1,024 tokens, short 2..63: quick to draw


@pytest.fixture(scope="module")
def agentic():
    spec = WorkloadSpec("agentic", vocab_size=512, seed=7, context_scale=SCALE, output_scale=1.0)
    return spec, spec.requests(4000)


def test_agentic_inputs_are_bimodal_with_53_percent_long(agentic):
    spec, requests = agentic
    long = [r for r in requests if r.long_context]
    assert len(long) / len(requests) == pytest.approx(AGENTIC_LONG_FRACTION, abs=0.025)
    lo, hi = (round(x * SCALE) for x in AGENTIC_LONG_RANGE)
    assert all(lo <= r.input_len <= hi for r in long)
    assert all(r.input_len <= lo for r in requests if not r.long_context)
    # log-uniform: the median is the geometric mean of the range (256K at scale 1)
    assert statistics.median(r.input_len for r in long) == pytest.approx((lo * hi) ** 0.5, rel=0.1)
    short_lo, short_hi = (x * SCALE for x in AGENTIC_SHORT_RANGE)
    short_median = statistics.median(r.input_len for r in requests if not r.long_context)
    assert short_median == pytest.approx((short_lo * short_hi) ** 0.5, rel=0.15)


def test_agentic_outputs_are_short_with_median_400(agentic):
    spec, requests = agentic
    outputs = [r.output_len for r in requests]
    assert statistics.median(outputs) == pytest.approx(AGENTIC_OUTPUT_MEDIAN, rel=0.05)
    assert all(r.input_len + r.output_len <= spec.max_request_len() for r in requests)
    assert all(0 <= t < 512 for r in requests[:50] for t in r.prompt_token_ids)


def test_output_scale_defaults_to_the_context_scale():
    scaled = WorkloadSpec("agentic", context_scale=1 / 8, seed=3).requests(400)
    assert statistics.median(r.output_len for r in scaled) == pytest.approx(AGENTIC_OUTPUT_MEDIAN / 8, rel=0.1)


def test_same_seed_same_requests_and_a_shorter_list_is_a_prefix():
    spec = WorkloadSpec("agentic", context_scale=SCALE, seed=1)
    assert spec.requests(30) == spec.requests(30)
    assert spec.requests(10) == spec.requests(30)[:10]
    assert WorkloadSpec("agentic", context_scale=SCALE, seed=2).requests(10) != spec.requests(10)


def test_random_lengths_stay_within_the_range_ratio():
    exact = WorkloadSpec("random", input_len=100, output_len=20, seed=0).requests(20)
    assert {(r.input_len, r.output_len) for r in exact} == {(100, 20)}
    spread = WorkloadSpec("random", input_len=100, output_len=20, range_ratio=0.5, seed=0)
    requests = spread.requests(500)
    assert min(r.input_len for r in requests) >= 50 and max(r.input_len for r in requests) <= 150
    assert min(r.output_len for r in requests) >= 10 and max(r.output_len for r in requests) <= 30
    assert len({r.input_len for r in requests}) > 50
    assert max(r.input_len + r.output_len for r in requests) <= spread.max_request_len()


def test_a_bad_workload_is_refused_with_what_to_change():
    with pytest.raises(ValueError, match="range-ratio"):
        WorkloadSpec("random", range_ratio=1.5)
    with pytest.raises(ValueError, match="unknown"):
        WorkloadSpec("sharegpt")



def test_each_session_turn_extends_the_previous_prompt_by_its_answer_and_new_input():
    scale = 1 / 64
    spec = WorkloadSpec("sessions", vocab_size=512, seed=5, context_scale=scale, output_scale=1 / 8, num_turns=5)
    sessions = spec.sessions(200)
    assert [len(s) for s in sessions] == [5] * 200
    first_turns = [s[0] for s in sessions]
    # the first turn is an agentic request: the seed's bimodal context and short answer
    assert sum(r.long_context for r in first_turns) / 200 == pytest.approx(AGENTIC_LONG_FRACTION, abs=0.1)
    assert sessions[0][0] == WorkloadSpec("agentic", vocab_size=512, seed=5, context_scale=scale,
                                          output_scale=1 / 8).requests(1)[0]
    new_lo, new_hi = (round(x * scale) for x in SESSION_NEW_INPUT_RANGE)
    added = []
    for session in sessions:
        for previous, turn in zip(session, session[1:]):
            assert turn.prompt_token_ids[: previous.input_len] == previous.prompt_token_ids
            new_input = turn.input_len - previous.input_len - previous.output_len  # after the answer's tokens
            assert new_lo <= new_input <= new_hi
            assert turn.long_context == previous.long_context
            added.append(new_input)
        assert session[-1].input_len + session[-1].output_len <= spec.max_request_len()
    # log-uniform new input: median the geometric mean of its range (~2.9K tokens per turn at scale 1)
    assert statistics.median(added) == pytest.approx((new_lo * new_hi) ** 0.5, rel=0.15)
    outputs = [r.output_len for s in sessions for r in s]
    assert statistics.median(outputs) == pytest.approx(AGENTIC_OUTPUT_MEDIAN / 8, rel=0.1)


def test_sessions_are_seeded_and_a_shorter_list_is_a_prefix():
    spec = WorkloadSpec("sessions", vocab_size=512, seed=1, context_scale=SCALE, num_turns=3)
    assert spec.sessions(12) == spec.sessions(12)
    assert spec.sessions(4) == spec.sessions(12)[:4]
    assert WorkloadSpec("sessions", vocab_size=512, seed=2, context_scale=SCALE, num_turns=3).sessions(4) \
        != spec.sessions(4)
    # other workloads are sessions of one request
    agentic = WorkloadSpec("agentic", context_scale=SCALE, seed=1)
    assert agentic.sessions(6) == [[r] for r in agentic.requests(6)]
    with pytest.raises(ValueError, match="num-turns"):
        WorkloadSpec("sessions", num_turns=0)
    with pytest.raises(ValueError, match="sessions\\(\\)"):
        spec.requests(3)


# --- /metrics ---------------------------------------------------------------------------------

# Scraped from `kvshard serve kvshard-demo-mla -tp 2 --dcp 2 --kv-cache-memory 4MiB --max-model-len 2048`
# in the middle of a `kvshard bench serve` run (verbatim lines; histograms and a few families left out).
KVSHARD_METRICS = """\
# HELP kvshard:time_to_first_token_seconds Time from arrival to the first token.
# TYPE kvshard:time_to_first_token_seconds histogram
kvshard:time_to_first_token_seconds_count{model_name="kvshard-demo-mla"} 17.0
kvshard:time_to_first_token_seconds_sum{model_name="kvshard-demo-mla"} 7.5321141510003145
# HELP kvshard:request_success_total Finished sequences, by finish reason.
# TYPE kvshard:request_success_total counter
kvshard:request_success_total{finished_reason="stop",model_name="kvshard-demo-mla"} 0.0
kvshard:request_success_total{finished_reason="length",model_name="kvshard-demo-mla"} 16.0
kvshard:request_success_total{finished_reason="abort",model_name="kvshard-demo-mla"} 0.0
# HELP kvshard:request_success_created Finished sequences, by finish reason.
# TYPE kvshard:request_success_created gauge
kvshard:request_success_created{finished_reason="stop",model_name="kvshard-demo-mla"} 1.796021011306249e+09
# HELP kvshard:dcp_layout_info The parallel layout and KV capacity this server started with.
# TYPE kvshard:dcp_layout_info gauge
kvshard:dcp_layout_info{block_size="16",dcp="2",interleave="1",kv_capacity_tokens="3264",max_model_len="2048",model_name="kvshard-demo-mla",num_kv_blocks_per_rank="102",tp="2"} 1.0
# HELP kvshard:num_requests_running Sequences in the running batch.
# TYPE kvshard:num_requests_running gauge
kvshard:num_requests_running{model_name="kvshard-demo-mla"} 2.0
# HELP kvshard:num_requests_waiting Sequences waiting to be admitted.
# TYPE kvshard:num_requests_waiting gauge
kvshard:num_requests_waiting{model_name="kvshard-demo-mla"} 1.0
# HELP kvshard:kv_cache_usage_perc Fraction of KV blocks in use (1 = full), same on every rank.
# TYPE kvshard:kv_cache_usage_perc gauge
kvshard:kv_cache_usage_perc{model_name="kvshard-demo-mla"} 0.16666666666666666
# HELP kvshard:dcp_rank_kv_cache_usage_perc Fraction of a DCP rank's KV slots holding tokens of live requests.
# TYPE kvshard:dcp_rank_kv_cache_usage_perc gauge
kvshard:dcp_rank_kv_cache_usage_perc{dcp_rank="0",model_name="kvshard-demo-mla"} 0.1568627450980392
kvshard:dcp_rank_kv_cache_usage_perc{dcp_rank="1",model_name="kvshard-demo-mla"} 0.15625
# HELP kvshard:num_preemptions_total Sequences preempted (KV freed, recomputed later).
# TYPE kvshard:num_preemptions_total counter
kvshard:num_preemptions_total{model_name="kvshard-demo-mla"} 0.0
# HELP kvshard:prompt_tokens_total Prompt tokens admitted (times n).
# TYPE kvshard:prompt_tokens_total counter
kvshard:prompt_tokens_total{model_name="kvshard-demo-mla"} 4308.0
# HELP kvshard:generation_tokens_total Tokens generated.
# TYPE kvshard:generation_tokens_total counter
kvshard:generation_tokens_total{model_name="kvshard-demo-mla"} 277.0
# HELP kvshard:engine_steps_total Engine steps run.
# TYPE kvshard:engine_steps_total counter
kvshard:engine_steps_total{model_name="kvshard-demo-mla"} 65.0
# HELP kvshard:engine_step_seconds_total Time in engine steps, by kind.
# TYPE kvshard:engine_step_seconds_total counter
kvshard:engine_step_seconds_total{kind="prefill",model_name="kvshard-demo-mla"} 1.25
kvshard:engine_step_seconds_total{kind="decode",model_name="kvshard-demo-mla"} 0.5
"""


def test_a_kvshard_scrape_gives_the_gauges_the_counters_and_the_layout():
    snapshot = parse_metrics(KVSHARD_METRICS)
    assert snapshot.running == 2 and snapshot.waiting == 1
    # the per-DCP-rank usage gauges do not leak into the engine-wide one
    assert snapshot.kv_usage == pytest.approx(1 / 6)
    assert (snapshot.preemptions, snapshot.prompt_tokens, snapshot.generation_tokens) == (0, 4308, 277)
    assert snapshot.engine_steps == 65
    assert (snapshot.prefill_step_seconds, snapshot.decode_step_seconds) == (1.25, 0.5)
    assert snapshot.layout["dcp"] == "2" and snapshot.layout["kv_capacity_tokens"] == "3264"
    assert snapshot.num_ranks == 2


# Scraped from vLLM 0.32.0 (CPU) `vllm serve` of the same demo model during a `kvshard bench serve` run.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="kvshard-demo-gqa"} 8.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="kvshard-demo-gqa"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="kvshard-demo-gqa"} 0.00586080586080584
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="kvshard-demo-gqa"} 0.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="kvshard-demo-gqa"} 1.7960233520428176e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="kvshard-demo-gqa"} 4804.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="kvshard-demo-gqa"} 1.7960233520428286e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="kvshard-demo-gqa"} 650.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="kvshard-demo-gqa"} 1.7960233520429404e+09
"""


def test_a_vllm_scrape_is_read_by_the_same_names():
    snapshot = parse_metrics(VLLM_METRICS)
    assert (snapshot.running, snapshot.waiting, snapshot.preemptions) == (8, 0, 0)
    assert snapshot.kv_usage == pytest.approx(0.00586, abs=1e-5)
    assert (snapshot.prompt_tokens, snapshot.generation_tokens) == (4804, 650)
    assert snapshot.layout == {} and snapshot.num_ranks is None
    assert MetricsTrace([snapshot, snapshot]).prefill_step_share is None  # vLLM reports no step time


def test_prefix_cache_counters_are_read_by_their_short_names():
    for prefix in ("kvshard", "vllm"):
        text = "".join(f"# TYPE {prefix}:prefix_cache_{name}_total counter\n{prefix}:prefix_cache_{name}_total"
                       f'{{model_name="m"}} {value}\n' for name, value in (("queries", 1000.0), ("hits", 992.0)))
        snapshot = parse_metrics(text)
        assert (snapshot.prefix_cache_queries, snapshot.prefix_cache_hits) == (1000, 992)


def test_trace_peaks_and_time_weighted_means():
    trace = MetricsTrace([
        ServerSnapshot(time=0.0, running=2, kv_usage=0.2, preemptions=1, engine_steps=100),
        ServerSnapshot(time=1.0, running=8, kv_usage=0.9, waiting=5, preemptions=1, engine_steps=140),
        ServerSnapshot(time=4.0, running=0, kv_usage=0.0, preemptions=4, engine_steps=250),
    ])
    assert (trace.peak_running, trace.peak_waiting, trace.peak_kv_usage) == (8, 5, 0.9)
    assert trace.mean_running == pytest.approx((2 * 1 + 8 * 3) / 4)
    assert (trace.preemptions, trace.engine_steps) == (3, 150)


def test_the_prefill_share_of_step_time_over_a_trace():
    trace = MetricsTrace([
        ServerSnapshot(time=0.0, prefill_step_seconds=10.0, decode_step_seconds=4.0),  # an earlier point's
        ServerSnapshot(time=1.0, prefill_step_seconds=10.5, decode_step_seconds=5.0),
        ServerSnapshot(time=2.0, prefill_step_seconds=13.0, decode_step_seconds=5.0),
    ])
    assert trace.prefill_step_share == pytest.approx(3.0 / 4.0)
    assert trace.summary()["prefill_step_share"] == pytest.approx(0.75)
    assert MetricsTrace([ServerSnapshot(), ServerSnapshot(time=1.0)]).prefill_step_share is None  # no step ran


def test_output_throughput_while_requests_waited_leaves_the_ramp_down_out():
    trace = MetricsTrace([
        ServerSnapshot(time=0.0, waiting=0, generation_tokens=1000),  # an earlier point's tokens
        ServerSnapshot(time=0.5, waiting=3, generation_tokens=1010),  # the queue fills: not yet counted
        ServerSnapshot(time=1.5, waiting=4, generation_tokens=1110),  # 100 tokens in 1 s, waiting throughout
        ServerSnapshot(time=2.5, waiting=1, generation_tokens=1190),  # 80 in 1 s
        ServerSnapshot(time=3.0, waiting=0, generation_tokens=1230),  # the queue empties on the way: not counted
        ServerSnapshot(time=5.0, waiting=0, generation_tokens=1260),  # the ramp-down
    ])
    assert trace.saturated_generation() == (180.0, 2.0)
    assert trace.saturated_output_throughput == pytest.approx(90.0)
    summary = trace.summary()
    assert summary["saturated_output_throughput"] == pytest.approx(90.0) and summary["saturated_seconds"] == 2.0
    # under SATURATED_MIN_SECONDS with requests waiting, or never: no figure
    short = MetricsTrace([ServerSnapshot(time=0.0, waiting=2), ServerSnapshot(time=0.5, waiting=2,
                                                                                generation_tokens=50)])
    assert short.saturated_output_throughput is None
    assert MetricsTrace([ServerSnapshot(), ServerSnapshot(time=9.0, generation_tokens=900)]).saturated_output_throughput is None


def test_summary_of_request_outcomes():
    outcomes = [
        RequestOutcome(input_len=100, success=True, output_len=11, ttft=0.5, latency=1.5, itl=[0.1] * 10),
        RequestOutcome(input_len=100, success=True, output_len=11, ttft=1.5, latency=3.5, itl=[0.2] * 10),
        RequestOutcome(input_len=100, error="HTTP 400: too long"),
    ]
    result = summarize(outcomes, duration=4.0, num_ranks=2)
    assert (result["completed"], result["failed"], result["errors"]) == (2, 1, ["HTTP 400: too long"])
    assert result["output_throughput"] == pytest.approx(22 / 4)
    assert result["output_throughput_per_rank"] == pytest.approx(22 / 4 / 2)
    assert result["total_token_throughput"] == pytest.approx(222 / 4)
    assert result["mean_ttft_ms"] == pytest.approx(1000)
    assert result["median_tpot_ms"] == pytest.approx(150)
    assert result["p99_itl_ms"] == pytest.approx(200)
    assert result["total_cached_tokens"] is None and result["cached_fraction"] is None  # the server said nothing


def test_the_serve_report_gives_the_prefill_share_where_the_server_reports_step_time():
    from kvshard.bench.report import format_serve_result

    outcomes = [RequestOutcome(input_len=100, success=True, output_len=11, ttft=0.5, latency=1.5, itl=[0.1] * 10)]
    result = summarize(outcomes, duration=2.0, num_ranks=2)
    result.update(max_concurrency=1, request_rate="inf")
    kvshard = MetricsTrace([ServerSnapshot(prefill_step_seconds=1.0, decode_step_seconds=1.0),
                            ServerSnapshot(time=2.0, prefill_step_seconds=1.3, decode_step_seconds=1.9)])
    for trace, expected in ((kvshard, "25.0%"), (MetricsTrace([ServerSnapshot(), ServerSnapshot(time=2.0)]), None)):
        result["server"] = {**trace.summary(), "scrape_failures": 0}
        line = next((row for row in format_serve_result(result).splitlines()
                     if row.startswith("Step time in steps with prompt tokens")), None)
        if expected is None:  # vLLM: no such counter, no such line
            assert line is None
        else:
            assert line is not None and line.split()[-1] == expected


def test_the_serve_report_gives_the_throughput_while_requests_waited_where_they_did():
    from kvshard.bench.report import format_serve_result

    outcomes = [RequestOutcome(input_len=100, success=True, output_len=11, ttft=0.5, latency=1.5, itl=[0.1] * 10)]
    result = summarize(outcomes, duration=4.0, num_ranks=2)
    result.update(max_concurrency=1, request_rate="inf")
    waited = MetricsTrace([ServerSnapshot(waiting=2), ServerSnapshot(time=3.0, waiting=1, generation_tokens=75),
                           ServerSnapshot(time=4.0, generation_tokens=80)])
    for trace, expected in ((waited, "25.00"), (MetricsTrace([ServerSnapshot(), ServerSnapshot(time=4.0)]), None)):
        result["server"] = {**trace.summary(), "scrape_failures": 0}
        line = next((row for row in format_serve_result(result).splitlines()
                     if row.startswith("Output tok/s while requests waited")), None)
        if expected is None:
            assert line is None
        else:
            assert line is not None and "(3 s)" in line and line.split()[-1] == expected


def test_the_dcp_table_compares_the_layouts_while_requests_waited():
    from kvshard.bench.dcp import format_dcp_table, summarize_config

    def point(concurrency, rate, waited):
        return {"concurrency": concurrency, "output_throughput_per_rank": rate,
                "saturated_output_throughput_per_rank": waited, "limited_by": "KV memory",
                "server": {"peak_running": concurrency, "mean_running": concurrency / 2, "peak_kv_usage": 1.0,
                           "peak_waiting": concurrency, "preemptions": 1}}

    def config(label, points):
        return {"label": label, "layout": {"kv_capacity_tokens": "1000"}, "sweep_end": "", **summarize_config(points)}

    tp = config("TP=2", [point(1, 50.0, None), point(8, 100.0, 110.0), point(16, 90.0, 120.0)])
    dcp = config("TP=2 + DCP=2", [point(8, 150.0, 190.0), point(16, 160.0, 180.0)])
    # the best point by each figure, each from its own point
    assert (tp["best_output_throughput_per_rank"], tp["best_at_concurrency"]) == (100.0, 8)
    assert (tp["best_saturated_output_throughput_per_rank"], tp["best_saturated_at_concurrency"]) == (120.0, 16)
    dcp["vs_tp_only"] = {"max_concurrency": 1.0, "max_mean_running": 1.0, "output_throughput_per_rank": 1.6,
                         "saturated_output_throughput_per_rank": 190.0 / 120.0}
    table = format_dcp_table({"configs": [tp, dcp]})
    assert "while requests waited" in table and "120.0 (c=16)" in table and "190.0 (c=8)" in table
    assert table.splitlines()[-1].endswith("out tok/s per rank 1.60x (while requests waited 1.58x)")
    none = config("TP=2", [point(1, 50.0, None)])
    assert none["best_saturated_output_throughput_per_rank"] is None and "n/a" in format_dcp_table({"configs": [none]})


def test_a_dcp_point_gives_the_throughput_while_requests_waited_per_rank():
    from kvshard.bench.dcp import _POINT_FIELDS, point_of

    server = {**MetricsTrace([ServerSnapshot(waiting=4), ServerSnapshot(time=2.0, waiting=2, generation_tokens=300),
                              ServerSnapshot(time=3.0, generation_tokens=320)]).summary(), "layout": {}}
    result = {**dict.fromkeys(_POINT_FIELDS, 0), "num_prompts": 8, "duration_s": 3.0, "server": server}
    point = point_of(result, concurrency=4, num_ranks=2, max_num_seqs=256)
    assert point["saturated_output_throughput_per_rank"] == pytest.approx(75.0)  # 300 tokens in 2 s, over 2 ranks
    assert point["mean_step_ms"] is None and point["limited_by"] == "compute"
    result["server"] = {**MetricsTrace([ServerSnapshot(), ServerSnapshot(time=3.0)]).summary(), "layout": {}}
    assert point_of(result, 4, 2, 256)["saturated_output_throughput_per_rank"] is None


def test_summary_gives_cached_tokens_per_turn_of_a_session():
    outcomes = [
        RequestOutcome(input_len=100, success=True, output_len=4, ttft=0.4, latency=1.0, turn=0, cached_tokens=0),
        RequestOutcome(input_len=300, success=True, output_len=4, ttft=0.1, latency=1.0, turn=1, cached_tokens=96),
        RequestOutcome(input_len=200, success=True, output_len=4, ttft=0.3, latency=1.0, turn=0, cached_tokens=32),
        RequestOutcome(input_len=400, success=True, output_len=4, ttft=0.2, latency=1.0, turn=1, cached_tokens=192),
    ]
    result = summarize(outcomes, duration=2.0, num_ranks=2)
    assert result["total_cached_tokens"] == 320
    assert result["cached_fraction"] == pytest.approx(320 / 1000)
    first, second = result["turns"]
    assert (first["turn"], first["mean_input_len"], first["mean_cached_tokens"]) == (0, 150, 16)
    assert (second["turn"], second["mean_input_len"], second["mean_cached_tokens"]) == (1, 350, 144)
    assert second["cached_fraction"] == pytest.approx(288 / 700)
    assert second["median_ttft_ms"] == pytest.approx(150)


# --- real servers -----------------------------------------------------------------------------

MODEL = "kvshard-demo-gqa"  # 1 KV head: tp=2 with dcp=2 is valid
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def forked_servers(monkeypatch):
    """The bench's servers fork from the suite's forkserver, torch already imported, rather than start as fresh
    interpreters (tests/server_harness.py); the Ctrl-C test keeps a real `kvshard bench` subprocess."""
    from server_harness import fork_bench_server

    monkeypatch.setattr(ServerProcess, "launch", fork_bench_server)


def _group_is_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_bench_is_a_kvshard_subcommand():
    args = build_parser().parse_args(["bench", "dcp", "--dcp", "2", "4", "--concurrency", "1,4,16"])
    assert (args.dcp, args.concurrency) == ([2, 4], [1, 4, 16])


def test_a_server_that_cannot_start_reports_its_error_and_leaves_nothing(tmp_path, forked_servers):
    server = ServerProcess(MODEL, ["--kv-cache-memory", "lots"], tmp_path / "server.log", startup_timeout=60)
    with pytest.raises(ServerStartError, match="not a size"):
        server.start()
    assert server.process is None


def test_ctrl_c_in_the_middle_of_bench_dcp_stops_its_server_and_ranks(tmp_path):
    bench = subprocess.Popen(
        [sys.executable, "-m", "kvshard.bench", "dcp", MODEL, "-tp", "2", "--kv-cache-memory", "1MiB",
         "--workload", "random", "--input-len", "48", "--output-len", "400", "--concurrency", "2",
         "--output-dir", str(tmp_path), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as at a terminal
    )
    log = tmp_path / "server-tp2-dcp1.log"
    deadline = time.monotonic() + 120
    while "Application startup complete" not in (log.read_text() if log.exists() else ""):
        assert bench.poll() is None and time.monotonic() < deadline, bench.stdout.read()
        time.sleep(0.05)
    server_pid = int(re.search(r"Started server process \[(\d+)\]", log.read_text()).group(1))
    url = re.search(r"serving .* at (http://\S+)/v1 ", log.read_text()).group(1)
    while parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text).generation_tokens == 0:  # until requests run
        assert bench.poll() is None and time.monotonic() < deadline, bench.stdout.read()
        time.sleep(0.05)
    bench.send_signal(signal.SIGINT)
    out, _ = bench.communicate(timeout=60)
    assert bench.returncode == 130 and "interrupted" in out, out
    assert _group_is_gone(server_pid)


def test_tiny_dcp_run_of_agentic_sessions_prints_the_table_and_writes_json_and_png(tmp_path, capsys, forked_servers):
    workload = ["--workload", "sessions", "--num-turns", "2", "--context-scale", "1/1024", "--output-scale", "1/32"]
    code = bench_main([
        "dcp", MODEL, "-tp", "2", "--dcp", "2", "--kv-cache-memory", "2MiB", *workload, "--concurrency", "1",
        "--sweep-limit", "2", "--prompts-per-concurrency", "1", "--metrics-interval", "0.05",
        "--output-dir", str(tmp_path), "--no-progress",
    ])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "max concurrency" in out and "TP=2 + DCP=2 vs TP=2: max concurrency" in out
    assert "prefilling" in out and "step time prefilling" in out and "while requests waited" in out
    # both servers up before the first point, then the layouts take turns, the first of a turn alternating
    lines = [line.strip() for line in out.splitlines()]
    started = [i for i, line in enumerate(lines) if line.startswith("== ")]
    points = [(i, line.split(" c=")[0]) for i, line in enumerate(lines) if " c=" in line and "running peak" in line]
    assert len(started) == 2 and max(started) < points[0][0]
    assert [label for _, label in points] == ["TP=2", "TP=2 + DCP=2", "TP=2 + DCP=2", "TP=2"]

    result = json.loads((tmp_path / "dcp.json").read_text())
    sessions = WorkloadSpec("sessions", vocab_size=model_vocab_size(MODEL), context_scale=1 / 1024,
                            output_scale=1 / 32, num_turns=2).sessions(2)
    tp_only, with_dcp = result["configs"]
    assert (tp_only["label"], with_dcp["label"]) == ("TP=2", "TP=2 + DCP=2")
    for config in result["configs"]:
        # one point shows no saturation: the sweep doubles to 2, then stops at its limit unless saturated there
        assert [p["concurrency"] for p in config["points"]] == [1, 2]
        assert config["sweep_end"] in ("saturated at c=2", "not saturated: the sweep stopped at c=2 (--sweep-limit 2)")
        assert config["saturated"] == config["sweep_end"].startswith("saturated")
        for point, num_sessions in zip(config["points"], (1, 2)):
            assert (point["num_sessions"], point["num_prompts"]) == (num_sessions, 2 * num_sessions)
            assert point["completed"] == point["num_prompts"] and point["failed"] == 0
            assert point["total_output_tokens"] == sum(t.output_len for s in sessions[:num_sessions] for t in s)
            # each point starts from an empty cache: a first turn finds nothing, though it ran at the last point
            assert point["turns"][0]["mean_cached_tokens"] == 0
            share = point["server"]["prefill_step_share"]  # prompts to prefill and answers to decode: some of each
            assert share is not None and 0 < share < 1
        assert config["layout"]["tp"] == "2" and config["max_concurrency_reached"] >= 1
        with pytest.raises(httpx.HTTPError):  # stopped
            httpx.get(f"{config['base_url']}/health", timeout=2)
    # the same per-rank budget holds twice the tokens with dcp=2 (read from each server's /metrics)
    assert int(with_dcp["layout"]["kv_capacity_tokens"]) == 2 * int(tp_only["layout"]["kv_capacity_tokens"])
    assert (tmp_path / "dcp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_interleave_one_server_runs_at_a_time(tmp_path, capsys, forked_servers):
    # where the servers would share GPUs: each layout's server up for its own sweep only, the sweeps one after the other
    code = bench_main([
        "dcp", MODEL, "-tp", "2", "--dcp", "2", "--kv-cache-memory", "2MiB", "--workload", "random",
        "--input-len", "16", "--output-len", "4", "--concurrency", "1", "--sweep-limit", "0", "--no-interleave",
        "--metrics-interval", "0.05", "--output-dir", str(tmp_path), "--no-progress",
    ])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = [line.strip() for line in out.splitlines()]
    order = [line.split(":")[0] if line.startswith("== ") else line.split(" c=")[0] for line in lines
             if line.startswith("== ") or ("running peak" in line and " c=" in line)]
    assert order == ["== TP=2", "TP=2", "== TP=2 + DCP=2", "TP=2 + DCP=2"]  # interleaved: both servers first
    assert [[p["concurrency"] for p in c["points"]] for c in json.loads((tmp_path / "dcp.json").read_text())["configs"]] \
        == [[1], [1]]


def test_python_m_kvshard_bench_runs_without_the_main_cli():
    done = subprocess.run([sys.executable, "-m", "kvshard.bench", "throughput", "--help"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and "--engine" in done.stdout


def test_vllm_runs_in_the_dtype_kvshard_resolves(monkeypatch, capsys):
    """vLLM's own dtype="auto" turns a float32 checkpoint into bfloat16 on CPU: the comparison
    passes kvshard's resolved dtype instead (vLLM itself is replaced by a recorder here)."""
    import kvshard.bench.throughput as throughput

    seen = []

    def fake_vllm(model_path, engine_kwargs, requests, repeats, progress):
        seen.append(engine_kwargs)
        return [1.0], sum(r.output_len for r in requests), dict(engine_kwargs)

    monkeypatch.setattr(throughput, "run_vllm", fake_vllm)
    monkeypatch.setattr(throughput, "engine_version", lambda engine: "recorded")
    for flag, want in [("auto", "float32"), ("bfloat16", "bfloat16")]:
        assert bench_main(["throughput", MODEL, "--engine", "vllm", "--dtype", flag, "--num-prompts", "2",
                           "--input-len", "8", "--output-len", "4", "--no-progress"]) == 0
        assert seen[-1]["dtype"] == want
    assert "Throughput (vllm" in capsys.readouterr().out
