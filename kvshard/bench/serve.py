"""`kvshard bench serve`: a load generator for any OpenAI-compatible server, as `vllm bench serve`.

Each request is a token-id prompt sent to /v1/completions with `ignore_eos` and
`max_tokens` = its output length, streamed, so the client sees when every chunk
arrives: time to first token (TTFT), inter-token latency (ITL, between chunks)
and time per output token (TPOT, (latency - TTFT) / (tokens - 1)). Requests
arrive as a Poisson process of `request_rate` per second (inf: all at once),
at most `max_concurrency` in flight. Meanwhile a thread scrapes the server's
/metrics for the peak KV usage and the peak number of running requests.

The unit of work is a session: a list of requests sent one after another, each
once the previous answer is complete, as an agent does (the sessions workload);
a plain request list is sessions of one request. Arrivals and `max_concurrency`
then count sessions. Where the server reports `usage.prompt_tokens_details.
cached_tokens` (kvshard always; vLLM with --enable-prompt-tokens-details), the
result gives the tokens its prefix cache served, in all and per turn.

A run stopped by Ctrl-C or SIGTERM raises `BenchmarkInterrupted`, which holds
the result of the requests that finished before it (marked `interrupted`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone

import httpx
from tqdm import tqdm

from kvshard.bench.metrics import MetricsPoller, ServerSnapshot
from kvshard.bench.workloads import BenchRequest


class BenchmarkError(RuntimeError):
    """The benchmark cannot run (server unreachable, request rejected); the message says why."""


class BenchmarkInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run. A KeyboardInterrupt still, so whatever catches that (bench dcp, the CLI)
    unwinds as before; `result` is the summary of the requests that finished, marked interrupted (None when
    none had)."""

    def __init__(self, result: dict | None) -> None:
        super().__init__("interrupted")
        self.result = result


def _as_ctrl_c(signum: int, frame: object) -> None:
    """SIGTERM handled by whatever handles Ctrl-C now: inside asyncio.run that cancels the run, as Ctrl-C does
    (a KeyboardInterrupt raised inside a task instead would leave it holding the exception, logged as never
    retrieved when it is collected); elsewhere a KeyboardInterrupt."""
    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler):  # Ctrl-C ignored (a background job) or not Python's: SIGTERM still stops the run
        handler = signal.default_int_handler
    handler(signal.SIGINT, frame)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so servers are stopped and what was measured is kept either way. Signal
    handlers can only be set from the main thread; elsewhere SIGTERM keeps its handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _as_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class RequestOutcome:
    input_len: int
    success: bool = False
    output_len: int = 0  # the server's usage.completion_tokens, else the chunks received
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # seconds between consecutive chunks
    error: str = ""
    turn: int = 0  # the request's place in its session
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache served, if it says


@dataclass
class _Progress:
    """What a run has measured so far, kept outside its coroutines: Ctrl-C cancels them, and the requests that
    had finished must still count."""

    outcomes: list[RequestOutcome] = field(default_factory=list)  # finished requests, as they finished
    start: float | None = None  # perf_counter when the first session was sent


def request_list_digest(requests: list[BenchRequest]) -> str:
    """A short fingerprint of the prompts and output lengths: equal digests, identical requests."""
    digest = hashlib.sha256()
    for request in requests:
        digest.update(json.dumps([request.prompt_token_ids, request.output_len]).encode())
    return digest.hexdigest()[:16]


def completion_payload(model: str, request: BenchRequest, extra_body: dict | None = None) -> dict:
    """The request sent; `extra_body`'s fields are added to it (e.g. a `response_format`)."""
    payload = {
        "model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
        "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }
    payload.update(extra_body or {})
    return payload


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The lines of an event stream, split at line feeds only. (httpx's `aiter_lines` also splits at U+2028,
    U+0085 and the other separators of `str.splitlines`, which a server may send unescaped inside a JSON
    string: vLLM does.)"""
    pending = ""
    async for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


def _token_count(value: object) -> int | None:
    """A token count of a server's usage block, or None for what is not one (a string, a negative or fractional
    number): a server that sends such a value has said nothing the summary's sums could use."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not value.is_integer():  # also nan and inf
        return None
    return int(value) if value >= 0 else None


def _event_error(event: object) -> str | None:
    """Why a stream event ends its request, or None for a chunk. Servers differ: vLLM and kvshard send
    {"error": {"message": ...}}, others a bare string."""
    if not isinstance(event, dict):
        return f"the server sent an event that is not a JSON object: {json.dumps(event)[:300]}"
    if "error" not in event:
        return None
    error = event["error"]
    return str(error.get("message", error) if isinstance(error, dict) else error)


async def send_request(client: httpx.AsyncClient, url: str, model: str, request: BenchRequest,
                       headers: dict[str, str], extra_body: dict | None = None) -> RequestOutcome:
    outcome = RequestOutcome(request.input_len)
    chunks = 0
    usage_tokens: int | None = None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=completion_payload(model, request, extra_body),
                                 headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                outcome.error = f"HTTP {response.status_code}: {body[:300]}"
                return outcome
            done = False
            async for line in sse_lines(response.aiter_text()):
                # read on to the body's end after [DONE]: a response left unread closes its connection, and every
                # request then paid a new one (its TCP set-up, and the server's) instead of reusing it
                if done or not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                problem = _event_error(event)
                if problem is not None:
                    outcome.error = problem
                    return outcome
                now = time.perf_counter()
                if event.get("choices"):
                    if chunks == 0:
                        outcome.ttft = now - start
                    else:
                        outcome.itl.append(now - last)
                    last = now
                    chunks += 1
                usage = event.get("usage")
                if isinstance(usage, dict):  # a server that leaves a count out (or garbles it): the chunks count
                    completion_tokens = _token_count(usage.get("completion_tokens"))
                    usage_tokens = usage_tokens if completion_tokens is None else completion_tokens
                    details = usage.get("prompt_tokens_details")
                    outcome.cached_tokens = (_token_count(details.get("cached_tokens"))
                                             if isinstance(details, dict) else None)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        outcome.error = f"{type(error).__name__}: {error}"
        return outcome
    outcome.latency = time.perf_counter() - start
    outcome.output_len = usage_tokens if usage_tokens is not None else chunks
    outcome.success = chunks > 0
    if not outcome.success:
        outcome.error = "the stream ended without a token"
    return outcome


async def _arrivals(sessions: list[list[BenchRequest]], request_rate: float, seed: int,
                    arrival_times: list[float] | None = None):
    """Yield sessions at the given arrival times (seconds from the start: a trace's recorded ones), else at
    Poisson arrival times (exponential gaps), or all at once for inf."""
    rng = random.Random(seed)
    start = time.perf_counter()
    for i, session in enumerate(sessions):
        if arrival_times is not None:
            delay = arrival_times[i] - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
        elif i and math.isfinite(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
        yield session


async def _run(base_url: str, model: str, sessions: list[list[BenchRequest]], max_concurrency: int | None,
               request_rate: float, seed: int, headers: dict[str, str], poller: MetricsPoller,
               progress: bool, label: str, arrival_times: list[float] | None = None,
               extra_body: dict | None = None,
               measured: _Progress | None = None) -> tuple[list[RequestOutcome], float]:
    measured = measured if measured is not None else _Progress()
    url = f"{base_url}/v1/completions"
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=sum(len(s) for s in sessions), desc=label, unit="req", disable=not progress,
               dynamic_ncols=True)

    async def turns(client: httpx.AsyncClient, session: list[BenchRequest]) -> list[RequestOutcome]:
        outcomes = []
        for turn, request in enumerate(session):
            if outcomes and not outcomes[-1].success:  # an agent whose call failed does not go on
                outcome = RequestOutcome(request.input_len, error="an earlier turn of its session failed")
            else:
                outcome = await send_request(client, url, model, request, headers, extra_body)
            outcome.turn = turn
            outcomes.append(outcome)
            measured.outcomes.append(outcome)
            snapshot = poller.latest
            if snapshot is not None:
                bar.set_postfix(running=int(snapshot.running), waiting=int(snapshot.waiting),
                                kv=f"{snapshot.kv_usage:.0%}", refresh=False)
            bar.update(1)
        return outcomes

    async def one(client: httpx.AsyncClient, session: list[BenchRequest]) -> list[RequestOutcome]:
        if limit is None:
            return await turns(client, session)
        async with limit:
            return await turns(client, session)

    connections = httpx.Limits(max_connections=max_concurrency or len(sessions), max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=30.0)
    try:
        async with httpx.AsyncClient(timeout=timeout, limits=connections) as client:
            start = measured.start = time.perf_counter()
            tasks = [asyncio.create_task(one(client, s)) async for s in _arrivals(sessions, request_rate, seed, arrival_times)]
            outcomes = await asyncio.gather(*tasks)
            return [o for session in outcomes for o in session], time.perf_counter() - start
    finally:
        bar.close()


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def list_models(base_url: str, api_key: str | None = None) -> list[dict]:
    """The server's /v1/models entries (id, and for kvshard and vLLM the checkpoint path as root)."""
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=_auth(api_key), timeout=10.0)
        response.raise_for_status()
        models = response.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
        raise BenchmarkError(f"cannot list the models of the server at {base_url}: {error}") from None
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise BenchmarkError(f"the server at {base_url} answered /v1/models without a list of models: "
                             f"{response.text[:300]}")
    return models


def served_model_entry(base_url: str, model: str | None, api_key: str | None = None) -> dict:
    """The /v1/models entry of `model` (or the server's first model); {} if the server has none of that name.
    kvshard and vLLM give the checkpoint path as `root` and the context limit as `max_model_len`."""
    return next((m for m in list_models(base_url, api_key) if model is None or m.get("id") == model), {})


def served_model_root(base_url: str, model: str | None, api_key: str | None = None) -> str | None:
    """The checkpoint path a server reports for `model` (or its first model), if it reports one."""
    return served_model_entry(base_url, model, api_key).get("root")


def probe(base_url: str, model: str | None, api_key: str | None) -> str:
    """Check the server answers a tiny token-id completion; return the model name to use."""
    if model is None:
        models = list_models(base_url, api_key)
        model = models[0].get("id") if models else None
        if not isinstance(model, str):
            raise BenchmarkError(f"the server at {base_url} names no model in /v1/models: pass --model")
    try:
        response = httpx.post(f"{base_url}/v1/completions", headers=_auth(api_key), timeout=120.0, json={
            "model": model, "prompt": [1, 2, 3, 4], "max_tokens": 2, "ignore_eos": True, "temperature": 0.0})
    except httpx.HTTPError as error:
        raise BenchmarkError(f"cannot reach the server at {base_url}: {error}") from None
    if response.status_code != 200:
        raise BenchmarkError(f"the server rejected a test request (HTTP {response.status_code}): "
                             f"{response.text[:300]}")
    return model


def reset_prefix_cache(base_url: str, api_key: str | None = None) -> None:
    """Empty the server's prefix cache (kvshard; vLLM only with VLLM_SERVER_DEV_MODE=1), so that a run
    finds no prompt of an earlier run cached."""
    try:
        response = httpx.post(f"{base_url.rstrip('/')}/reset_prefix_cache", headers=_auth(api_key), timeout=60.0)
    except httpx.HTTPError as error:
        raise BenchmarkError(f"cannot reset the prefix cache of the server at {base_url}: {error}") from None
    if response.status_code != 200:
        raise BenchmarkError(f"the server refused to reset its prefix cache (HTTP {response.status_code}): "
                             f"{response.text[:300]}")


def run_serve_benchmark(
    base_url: str,
    sessions: list[list[BenchRequest]],
    model: str | None = None,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
    num_ranks: int | None = None,
    api_key: str | None = None,
    metrics_interval: float = 0.25,
    progress: bool = True,
    label: str = "bench serve",
    arrival_times: list[float] | None = None,
    extra_body: dict | None = None,
) -> dict:
    """Send every session (its turns one after another), wait for all, and return the result (see `summarize`).

    `arrival_times`: when each session starts, in seconds from the first (a trace's recorded arrivals);
    otherwise Poisson arrivals at `request_rate`. `max_concurrency` caps the sessions in flight either way."""
    if not sessions or not all(sessions):
        raise BenchmarkError("no requests to send: --num-prompts must be at least 1")
    if arrival_times is not None and len(arrival_times) != len(sessions):
        raise BenchmarkError(f"{len(arrival_times)} arrival times for {len(sessions)} sessions")
    if max_concurrency is not None and max_concurrency < 1:
        raise BenchmarkError(f"--max-concurrency must be at least 1, got {max_concurrency}")
    if not request_rate > 0:
        raise BenchmarkError(f"--request-rate must be positive (inf: all at once), got {request_rate}")
    base_url = base_url.rstrip("/")
    model = probe(base_url, model, api_key)
    measured = _Progress()
    poller = MetricsPoller(base_url, metrics_interval, api_key)
    try:
        with sigterm_as_interrupt(), poller:
            outcomes, duration = asyncio.run(_run(base_url, model, sessions, max_concurrency, request_rate, seed,
                                                  _auth(api_key), poller, progress, label, arrival_times,
                                                  extra_body, measured))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the requests that finished are a measurement too
        if not measured.outcomes:
            raise BenchmarkInterrupted(None) from None
        result = _result(measured.outcomes, time.perf_counter() - measured.start, sessions, poller, base_url,
                         model, max_concurrency, request_rate, num_ranks, arrival_times)
        result.update({"interrupted": True, "unfinished_requests": result["num_prompts"] - len(measured.outcomes)})
        raise BenchmarkInterrupted(result) from None
    return _result(outcomes, duration, sessions, poller, base_url, model, max_concurrency, request_rate, num_ranks,
                   arrival_times)


def _result(outcomes: list[RequestOutcome], duration: float, sessions: list[list[BenchRequest]],
            poller: MetricsPoller, base_url: str, model: str, max_concurrency: int | None, request_rate: float,
            num_ranks: int | None, arrival_times: list[float] | None) -> dict:
    """The summary of `outcomes` over `duration`, with what was sent and what the server's /metrics said."""
    first = poller.trace.snapshots[0] if poller.trace.snapshots else ServerSnapshot()
    result = summarize(outcomes, duration, num_ranks or first.num_ranks)
    requests = [turn for session in sessions for turn in session]
    result.update({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": base_url, "model": model, "num_prompts": len(requests), "num_sessions": len(sessions),
        "max_concurrency": max_concurrency,
        "request_rate": ("trace" if arrival_times is not None else
                         request_rate if math.isfinite(request_rate) else "inf"),
        "requests_digest": request_list_digest(requests),
        "server": {**poller.trace.summary(), "scrape_failures": poller.failures, "layout": first.layout},
    })
    return result


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _stats(name: str, seconds: list[float]) -> dict:
    ms = [s * 1000 for s in seconds]
    return {
        f"mean_{name}_ms": sum(ms) / len(ms) if ms else 0.0,
        f"median_{name}_ms": _percentile(ms, 50),
        f"p90_{name}_ms": _percentile(ms, 90),
        f"p99_{name}_ms": _percentile(ms, 99),
    }


def summarize(outcomes: list[RequestOutcome], duration: float, num_ranks: int | None) -> dict:
    """Throughputs over the whole run and latency statistics over the successful requests."""
    done = [o for o in outcomes if o.success]
    output_tokens = sum(o.output_len for o in done)
    input_tokens = sum(o.input_len for o in done)
    tpot = [(o.latency - o.ttft) / (o.output_len - 1) for o in done if o.output_len > 1]
    result = {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "errors": sorted({o.error for o in outcomes if not o.success})[:5],
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "num_ranks": num_ranks,
        "output_throughput_per_rank": output_tokens / duration / num_ranks if num_ranks else None,
        "total_token_throughput_per_rank": (input_tokens + output_tokens) / duration / num_ranks if num_ranks else None,
    }
    result.update(_stats("ttft", [o.ttft for o in done]))
    result.update(_stats("tpot", tpot))
    result.update(_stats("itl", [t for o in done for t in o.itl]))
    result.update(_stats("e2el", [o.latency for o in done]))
    result.update(_cache_report(done))
    return result


def _cache_report(done: list[RequestOutcome]) -> dict:
    """Prompt tokens the server's prefix cache served, in all and per turn of a session
    (None where the server does not report them)."""
    def cached(outcomes: list[RequestOutcome]) -> int | None:
        reported = [o.cached_tokens for o in outcomes if o.cached_tokens is not None]
        return sum(reported) if reported else None

    def share(part: int | None, whole: int) -> float | None:
        return part / whole if part is not None and whole else None

    total_cached = cached(done)
    per_turn = []
    for turn in sorted({o.turn for o in done}):
        of_turn = [o for o in done if o.turn == turn]
        input_tokens, turn_cached = sum(o.input_len for o in of_turn), cached(of_turn)
        per_turn.append({
            "turn": turn, "completed": len(of_turn), "mean_input_len": input_tokens / len(of_turn),
            "mean_cached_tokens": turn_cached / len(of_turn) if turn_cached is not None else None,
            "cached_fraction": share(turn_cached, input_tokens),
            **_stats("ttft", [o.ttft for o in of_turn]),
        })
    return {"total_cached_tokens": total_cached,
            "cached_fraction": share(total_cached, sum(o.input_len for o in done)), "turns": per_turn}
