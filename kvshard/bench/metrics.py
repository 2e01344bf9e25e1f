"""Scrape a server's Prometheus /metrics while a benchmark runs.

Metric names are matched after their `prefix:` (kvshard:, vllm:), so the same
poller reads a kvshard server and a vLLM one. A background thread takes a
snapshot every `interval` seconds; the trace then gives the peaks and the
time-averaged values the reports need.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

# gauge or counter (name after the prefix) -> ServerSnapshot field; summed over label sets
_FIELDS = {
    "kv_cache_usage_perc": "kv_usage",
    "gpu_cache_usage_perc": "kv_usage",  # vLLM before v0.10
    "num_requests_running": "running",
    "num_requests_waiting": "waiting",
    "num_preemptions": "preemptions",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "engine_steps": "engine_steps",  # kvshard only
    "prefix_cache_queries": "prefix_cache_queries",  # prompt tokens looked up
    "prefix_cache_hits": "prefix_cache_hits",  # prompt tokens found
}
# kvshard:engine_step_seconds{kind=...}: one field per kind
_STEP_SECONDS = {"prefill": "prefill_step_seconds", "decode": "decode_step_seconds"}
SATURATED_MIN_SECONDS = 1.0  # a saturated throughput needs this long with requests waiting, else None
_LAYOUT_INFO = "dcp_layout_info"  # kvshard:dcp_layout_info{tp=..., dcp=..., ...} 1 (an Info metric)


@dataclass(frozen=True)
class ServerSnapshot:
    """One scrape. kv_usage is a fraction (1 = full), as vLLM's *_usage_perc."""

    time: float = 0.0
    kv_usage: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    preemptions: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    engine_steps: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    prefill_step_seconds: float = 0.0  # kvshard only: time in steps that computed prompt tokens
    decode_step_seconds: float = 0.0  # and in steps of decodes only
    layout: dict[str, str] = field(default_factory=dict)

    @property
    def num_ranks(self) -> int | None:
        """World size from the layout info metric (DCP reuses the TP ranks), if the server exports one."""
        tp = self.layout.get("tp")
        return int(tp) if tp else None


def parse_metrics(text: str, at: float = 0.0) -> ServerSnapshot:
    """Read the fields of a ServerSnapshot out of Prometheus text exposition."""
    values: dict[str, float] = {}
    layout: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        short = family.name.split(":")[-1]
        for sample in family.samples:
            if sample.name.split(":")[-1] == _LAYOUT_INFO:
                layout = dict(sample.labels)
            if short == "engine_step_seconds" and sample.name.endswith("_total"):
                kind = _STEP_SECONDS.get(sample.labels.get("kind", ""))
                if kind is not None:
                    values[kind] = values.get(kind, 0.0) + sample.value
        target = _FIELDS.get(short)
        if target is None:
            continue
        # a counter's samples are NAME_total and NAME_created: only the total counts
        for sample in family.samples:
            if family.type == "counter" and not sample.name.endswith("_total"):
                continue
            values[target] = values.get(target, 0.0) + sample.value
    return ServerSnapshot(time=at, layout=layout, **values)


def scrape(client: httpx.Client, base_url: str) -> ServerSnapshot:
    response = client.get(f"{base_url}/metrics")
    response.raise_for_status()
    return parse_metrics(response.text, time.monotonic())


@dataclass
class MetricsTrace:
    """Snapshots of one benchmark run, oldest first."""

    snapshots: list[ServerSnapshot] = field(default_factory=list)

    def _max(self, name: str) -> float:
        return max((getattr(s, name) for s in self.snapshots), default=0.0)

    @property
    def peak_kv_usage(self) -> float:
        return self._max("kv_usage")

    @property
    def peak_running(self) -> int:
        return int(self._max("running"))

    @property
    def peak_waiting(self) -> int:
        return int(self._max("waiting"))

    def _time_average(self, name: str) -> float:
        """Mean of a gauge over the trace, each scrape weighted by the time until the next."""
        if len(self.snapshots) < 2:
            return self._max(name)
        total = sum(getattr(a, name) * (b.time - a.time) for a, b in zip(self.snapshots, self.snapshots[1:]))
        return total / (self.snapshots[-1].time - self.snapshots[0].time)

    @property
    def mean_running(self) -> float:
        return self._time_average("running")

    @property
    def mean_kv_usage(self) -> float:
        return self._time_average("kv_usage")

    def _growth(self, name: str) -> int:
        """How much a counter grew during the trace."""
        return int(self._float_growth(name))

    def _float_growth(self, name: str) -> float:
        if not self.snapshots:
            return 0.0
        return getattr(self.snapshots[-1], name) - getattr(self.snapshots[0], name)

    @property
    def prefill_step_share(self) -> float | None:
        """The share of the engine's step time that went to steps computing prompt tokens (decodes riding
        along included); None where the server reports no step time (vLLM, or no step ran)."""
        prefill, decode = self._float_growth("prefill_step_seconds"), self._float_growth("decode_step_seconds")
        return prefill / (prefill + decode) if prefill + decode > 0 else None

    def saturated_generation(self) -> tuple[float, float]:
        """Output tokens generated, and the seconds they took, over the scrape intervals that began and ended with
        a request waiting: the server at its capacity (its batch as large as its KV cache or max-num-seqs lets
        it be). A closed-loop run ends in a ramp-down, the last requests finishing with nothing left to admit,
        whose share of the run grows with the batch the server holds; these intervals leave it out."""
        tokens = seconds = 0.0
        for a, b in zip(self.snapshots, self.snapshots[1:]):
            if a.waiting > 0 and b.waiting > 0:
                tokens += b.generation_tokens - a.generation_tokens
                seconds += b.time - a.time
        return tokens, seconds

    @property
    def saturated_output_throughput(self) -> float | None:
        """Output tok/s while requests waited (`saturated_generation`); None below SATURATED_MIN_SECONDS of it."""
        tokens, seconds = self.saturated_generation()
        return tokens / seconds if seconds >= SATURATED_MIN_SECONDS else None

    @property
    def preemptions(self) -> int:
        return self._growth("preemptions")

    @property
    def engine_steps(self) -> int:
        return self._growth("engine_steps")

    def summary(self) -> dict:
        return {
            "peak_kv_usage": self.peak_kv_usage, "mean_kv_usage": self.mean_kv_usage,
            "peak_running": self.peak_running, "mean_running": self.mean_running,
            "peak_waiting": self.peak_waiting, "preemptions": self.preemptions, "engine_steps": self.engine_steps,
            "prefix_cache_queries": self._growth("prefix_cache_queries"),
            "prefix_cache_hits": self._growth("prefix_cache_hits"),
            "prefill_step_seconds": self._float_growth("prefill_step_seconds"),
            "decode_step_seconds": self._float_growth("decode_step_seconds"),
            "prefill_step_share": self.prefill_step_share,
            "saturated_seconds": self.saturated_generation()[1],
            "saturated_output_throughput": self.saturated_output_throughput,
            "num_scrapes": len(self.snapshots),
        }


class MetricsPoller:
    """Scrape `base_url`/metrics every `interval` seconds on a thread, from start() to stop().

    A failed scrape is counted and skipped: the benchmark goes on and says so.
    """

    def __init__(self, base_url: str, interval: float = 0.25, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.interval = interval
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # /metrics may need the key
        self.trace = MetricsTrace()
        self.failures = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvshard-bench-metrics", daemon=True)

    @property
    def latest(self) -> ServerSnapshot | None:
        return self.trace.snapshots[-1] if self.trace.snapshots else None

    def start(self) -> "MetricsPoller":
        self._thread.start()
        return self

    def stop(self) -> MetricsTrace:
        self._stop.set()
        self._thread.join()
        return self.trace

    def _run(self) -> None:
        with httpx.Client(timeout=5.0, headers=self.headers) as client:
            while True:
                stopping = self._stop.is_set()  # after stop(): one last scrape, so counters cover the run
                try:
                    self.trace.snapshots.append(scrape(client, self.base_url))
                except (httpx.HTTPError, ValueError) as error:
                    self.failures += 1
                    self.last_error = str(error)
                if stopping:
                    return
                self._stop.wait(self.interval)

    def __enter__(self) -> "MetricsPoller":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
