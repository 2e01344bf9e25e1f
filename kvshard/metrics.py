"""Prometheus metrics of one server, named as vLLM's with a `kvshard:` prefix.

Engine gauges and totals come from the latest `EngineStats` the engine loop
recorded (so a scrape never waits for a step); latencies are observed by the
loop as tokens come out. Each server has its own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvshard.attention.timing import PHASES, DcpTimingReport
from kvshard.config import EngineConfig
from kvshard.engine.stats import EngineStats

# vLLM's buckets, in seconds
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    def __init__(self, config: EngineConfig, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.config = config
        self._stats = EngineStats()
        labels = ["model_name"]
        self.ttft = Histogram("kvshard:time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("kvshard:inter_token_latency_seconds", "Time between two tokens of a request.",
                             labels, buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("kvshard:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.request_success = Counter("kvshard:request_success", "Finished sequences, by finish reason.",
                                       [*labels, "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        parallel = config.parallel
        Info("kvshard:dcp_layout", "The parallel layout and KV capacity this server started with.",
             registry=self.registry).info({
                 "model_name": model_name,
                 "tp": str(parallel.tensor_parallel_size),
                 "dcp": str(parallel.decode_context_parallel_size),
                 "interleave": str(parallel.dcp_kv_interleave_size),
                 "attention_layout": parallel.attention_layout,
                 "attention_tp": str(parallel.attention_tp_size),
                 "dcp_comm_backend": parallel.dcp_comm_backend,
                 "kv_bytes_per_token_per_rank": f"{config.kv_bytes_per_token_per_rank:g}",
                 "replicated_projection_bytes_per_rank": str(config.replicated_projection_bytes_per_rank),
                 "block_size": str(config.cache.block_size),
                 "cache_dtype": config.cache.kv_cache_dtype,
                 "num_kv_blocks_per_rank": str(config.num_kv_blocks),
                 "kv_capacity_tokens": str(config.kv_capacity_tokens),
                 "max_model_len": str(config.scheduler.max_model_len),
             })
        self.registry.register(self)  # collect() below: the engine's gauges and totals

    def record_stats(self, stats: EngineStats) -> None:
        self._stats = stats

    def observe_finished(self, finish_reasons: list[str | None], e2e_seconds: float) -> None:
        for reason in finish_reasons:
            self.request_success.labels(self.model_name, reason or "abort").inc()
        self.e2e.observe(e2e_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self):
        """Gauges and totals from the last recorded EngineStats, at scrape time."""
        stats, name = self._stats, self.model_name
        slots_per_rank = self.config.num_kv_blocks * self.config.cache.block_size

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            return family

        yield gauge("kvshard:num_requests_running", "Sequences in the running batch.", stats.num_running)
        yield gauge("kvshard:num_requests_waiting", "Sequences waiting to be admitted.", stats.num_waiting)
        yield gauge("kvshard:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full), same on every rank.",
                    stats.kv_usage)
        yield gauge("kvshard:kv_cache_blocks_used", "KV blocks in use per rank (virtual blocks).", stats.kv_blocks_used)
        yield gauge("kvshard:kv_cache_blocks_total", "KV blocks per rank.", stats.kv_blocks_total)
        yield gauge("kvshard:kv_cache_blocks_cached", "KV blocks per rank holding a cached prefix, in use or free.",
                    stats.kv_blocks_cached)
        per_rank_usage = GaugeMetricFamily(
            "kvshard:dcp_rank_kv_cache_usage_perc",
            "Fraction of a DCP rank's KV slots holding tokens of live requests.", labels=["model_name", "dcp_rank"])
        per_rank_tokens = GaugeMetricFamily(
            "kvshard:dcp_rank_kv_cache_tokens", "Tokens of live requests stored on a DCP rank.",
            labels=["model_name", "dcp_rank"])
        for dcp_rank, tokens in enumerate(stats.kv_tokens_per_dcp_rank):
            per_rank_usage.add_metric([name, str(dcp_rank)], tokens / slots_per_rank)
            per_rank_tokens.add_metric([name, str(dcp_rank)], tokens)
        yield per_rank_usage
        yield per_rank_tokens
        yield from _dcp_timing_families(stats.dcp_timing, name)
        yield counter("kvshard:num_preemptions", "Sequences preempted (KV freed, recomputed later).",
                      stats.num_preemptions)
        yield counter("kvshard:prompt_tokens", "Prompt tokens admitted (times n).", stats.prompt_tokens)
        yield counter("kvshard:generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield counter("kvshard:engine_steps", "Engine steps run.", stats.steps)
        step_seconds = CounterMetricFamily(
            "kvshard:engine_step_seconds",
            "Time in engine steps (scheduling, the model, sampling, outputs), by kind: prefill, steps that computed "
            "prompt tokens (decodes may ride along); decode, steps of decodes and drafts only.",
            labels=["model_name", "kind"])
        step_seconds.add_metric([name, "prefill"], stats.prefill_step_seconds)
        step_seconds.add_metric([name, "decode"], stats.decode_step_seconds)
        yield step_seconds
        yield counter("kvshard:prefix_cache_queries", "Prompt tokens looked up in the prefix cache, at each admission "
                      "(a preempted request's re-admission again).",
                      stats.prefix_cache_queries)
        yield counter("kvshard:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        if self.config.speculative is not None:
            yield from _spec_decode_counters(stats, name)


def _spec_decode_counters(stats: EngineStats, name: str):
    """vLLM's speculative-decoding counters; mean acceptance length = 1 + accepted / drafts."""
    for metric, doc, value in (
        ("num_drafts", "Requests' steps that verified drafts.", stats.spec_decode_num_drafts),
        ("num_draft_tokens", "Draft tokens verified.", stats.spec_decode_num_draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted.", stats.spec_decode_num_accepted_tokens),
    ):
        family = CounterMetricFamily(f"kvshard:spec_decode_{metric}", doc, labels=["model_name"])
        family.add_metric([name], value)
        yield family
    per_pos = CounterMetricFamily("kvshard:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by position in the step's drafts.",
                                  labels=["model_name", "position"])
    for position, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
        per_pos.add_metric([name, str(position)], value)
    yield per_pos


def _dcp_timing_families(report: DcpTimingReport | None, name: str):
    """Every rank's seconds in DCP collectives, local attention and merge (as of the last gather
    among the ranks), their mean per step, and rank 0's merges by scheme."""
    if report is None:  # no DCP, timers off, or no gather yet
        return
    total = CounterMetricFamily("kvshard:dcp_seconds", "Seconds a rank spent in a DCP phase: collective "
                                "(Q all-gather, merge collectives), attention (over its KV shard), merge (LSE "
                                "arithmetic).", labels=["model_name", "rank", "phase"])
    per_step = GaugeMetricFamily("kvshard:dcp_seconds_per_step", "Mean seconds per engine step a rank spent "
                                 "in a DCP phase (compare rank 0 with the slowest rank).",
                                 labels=["model_name", "rank", "phase"])
    for phase in PHASES:
        for rank, (seconds, mean) in enumerate(zip((s[phase] for s in report.seconds), report.per_step(phase))):
            total.add_metric([name, str(rank), phase], seconds)
            per_step.add_metric([name, str(rank), phase], mean)
    merges = CounterMetricFamily("kvshard:dcp_merges", "Layer merges on rank 0, by scheme (--dcp-comm-backend).",
                                 labels=["model_name", "scheme"])
    for scheme, count in sorted(report.merges.items()):
        merges.add_metric([name, scheme], count)
    yield total
    yield per_step
    yield merges
