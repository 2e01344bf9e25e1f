"""A client that leaves early, at fixed points of its request, on every generation route.

Two in-process servers (`kvshard-demo-gqa` at tp=1, served by uvicorn on a thread so that a client can really hang
up): a plain engine and one with n-gram speculative decoding. A raw socket sends a request and closes after k bytes
of the answer, after the first event, after several, once the engine holds the request (an unstreamed answer), or
before its body is whole. Afterwards, polled with a deadline (an abort is counted as the client leaves and applied
by the engine thread between two steps): the engine holds no request and no KV block, /metrics shows no request
running and counts each of the request's sequences once (under "stop", "length", "abort" or "error"), and the
server still answers.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from kvshard.engine.arg_utils import EngineArgs
from kvshard.engine.llm_engine import LLMEngine
from kvshard.entrypoints.openai.serving_engine import with_connection_transport
from kvshard.entrypoints.openai_server import OpenAIServer
from server_harness import free_local_port, scraped_metrics as metrics, uvicorn_on_a_thread

MODEL = "kvshard-demo-gqa"
ENGINE = dict(max_model_len=256, kv_cache_memory="16MiB")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REASONS = ("stop", "length", "abort", "error")

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo? one two one two one two"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "items": {"type": "array",
                                                                                  "items": {"type": "integer"}}},
          "required": ["answer", "items"]}

# (route, body, sequences): what each case sends, and how many sequences the engine runs for it
CASES = {
    "completions": ("/v1/completions", dict(prompt="one two one two one two", max_tokens=200, n=2, logprobs=2,
                                            ignore_eos=True, seed=1, temperature=1.0), 2),
    "completions-2-prompts": ("/v1/completions", dict(prompt=["Hello", "one two one two"], max_tokens=150, n=2,
                                                      ignore_eos=True, seed=2, temperature=1.0), 4),
    "completions-echo": ("/v1/completions", dict(prompt="one two one two", echo=True, logprobs=1, max_tokens=150, n=2,
                                                 ignore_eos=True, seed=8, temperature=1.0), 2),
    "chat": ("/v1/chat/completions", dict(messages=MESSAGES, max_tokens=150, n=2, logprobs=True, top_logprobs=2,
                                          ignore_eos=True, seed=3, temperature=1.0), 2),
    "chat-tools-required": ("/v1/chat/completions", dict(messages=MESSAGES, tools=[CHAT_TOOL], tool_choice="required",
                                                         n=2, seed=4, temperature=1.0), 2),
    "chat-json-schema": ("/v1/chat/completions", dict(
        messages=MESSAGES, n=2, seed=5, temperature=1.0, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}), 2),
    "responses-tools": ("/v1/responses", dict(input="What is the weather in Oslo?", tools=[RESPONSES_TOOL],
                                              tool_choice="required", seed=6, temperature=1.0), 1),
    "responses": ("/v1/responses", dict(input="one two one two one two", max_output_tokens=150, seed=7,
                                        temperature=1.0), 1),
}
STREAM_EXTRAS = {"/v1/completions": {"stream_options": {"include_usage": True}},
                 "/v1/chat/completions": {"stream_options": {"include_usage": True}}, "/v1/responses": {}}


def _engine(speculative: bool) -> LLMEngine:
    extra = {"speculative_config": NGRAM} if speculative else {}
    return LLMEngine(EngineArgs.from_kwargs(MODEL, **ENGINE, **extra).create_engine_config())


@pytest.fixture(scope="module", params=["plain", "ngram"])
def served(request) -> Iterator[SimpleNamespace]:
    engine = _engine(request.param == "ngram")
    server = OpenAIServer(engine, [MODEL])
    port = free_local_port()
    url = f"http://127.0.0.1:{port}"
    with uvicorn_on_a_thread(uvicorn.Config(with_connection_transport(server.app), port=port, log_level="warning")), \
            httpx.Client(base_url=url, timeout=60) as http:
        yield SimpleNamespace(url=url, port=port, http=http, engine=engine)


def ended(before: dict, after: dict) -> dict[str, float]:
    def count(values, reason):
        return values.get(("kvshard:request_success_total", (("finished_reason", reason),)), 0.0)
    return {reason: count(after, reason) - count(before, reason) for reason in REASONS}


def _request_bytes(route: str, body: dict) -> bytes:
    data = json.dumps({"model": MODEL, **body}).encode()
    return (b"POST %s HTTP/1.1\r\nHost: kvshard\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (route.encode(), len(data), data))


def leave(served, route: str, body: dict, *, after_bytes: int | None = None, after_events: int | None = None,
          once_running: bool = False, body_cut: bool = False) -> bytes:
    """Send the request and close the connection: after `after_bytes` bytes of the answer, after `after_events`
    SSE events, once the engine holds the request, or (`body_cut`) with only part of its body sent; what was read."""
    raw = _request_bytes(route, body)
    got = b""
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        if body_cut:
            sock.sendall(raw[: len(raw) - len(raw) // 4])
            return got
        sock.sendall(raw)
        if once_running:
            deadline = time.monotonic() + 10
            while not served.engine.requests:
                assert time.monotonic() < deadline, "the request never reached the engine"
                time.sleep(0.005)
            return got
        while True:
            if after_bytes is not None and len(got) >= after_bytes:
                break
            if after_events is not None and b"\r\n\r\n" in got:
                if got.split(b"\r\n\r\n", 1)[1].count(b"\n\n") >= after_events:
                    break
            chunk = sock.recv(4096 if after_bytes is None else max(1, after_bytes - len(got)))
            if not chunk:
                break
            got += chunk
    return got


def settle(served, before: dict, sequences: int, may_not_start: bool = False) -> dict[str, float]:
    """Poll (10 s) until the engine holds nothing and /metrics counted the request's sequences; check it all."""
    start = time.monotonic()
    deadline = start + 10
    while True:
        after = metrics(served.http)
        counted = ended(before, after)
        total = sum(counted.values())
        released = not served.engine.requests and served.engine.pool.num_used == 0
        running = after[("kvshard:num_requests_running", ())]
        # a request the server dropped before it reached the engine counts nothing: given 3 s to show up (one that
        # reached it shows up within milliseconds; the wait is spent only if it never does)
        done = total == sequences or (may_not_start and total == 0 and time.monotonic() > start + 3)
        if (done and released and running == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not served.engine.requests, f"the engine still runs {list(served.engine.requests)}"
    assert served.engine.pool.num_used == 0, f"{served.engine.pool.num_used} KV blocks leaked"
    assert running == 0, running
    expected = {0, sequences} if may_not_start else {sequences}
    assert total in expected, (counted, sequences)
    # settled: nothing counted later
    time.sleep(0.1)
    assert ended(before, metrics(served.http)) == counted
    return counted


def still_serves(served) -> None:
    answer = served.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2,
                                                       "ignore_eos": True})
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length", answer.text
    assert served.http.get("/health").status_code == 200


STREAMED_POINTS = {"0-bytes": dict(after_bytes=0), "5-bytes": dict(after_bytes=5),
                   "1-event": dict(after_events=1), "4-events": dict(after_events=4)}


@pytest.mark.parametrize("point", list(STREAMED_POINTS))
@pytest.mark.parametrize("case", list(CASES))
def test_a_streaming_client_that_leaves(served, case, point):
    route, body, sequences = CASES[case]
    before = metrics(served.http)
    leave(served, route, {**body, "stream": True, **STREAM_EXTRAS[route]}, **STREAMED_POINTS[point])
    settle(served, before, sequences, may_not_start=point in ("0-bytes", "5-bytes"))
    still_serves(served)


@pytest.mark.parametrize("case", list(CASES))
def test_a_client_that_leaves_an_unstreamed_request(served, case):
    route, body, sequences = CASES[case]
    before = metrics(served.http)
    leave(served, route, body, once_running=True)
    settle(served, before, sequences)
    before = metrics(served.http)
    leave(served, route, body, after_bytes=0)
    settle(served, before, sequences, may_not_start=True)
    still_serves(served)


@pytest.mark.parametrize("route", list(STREAM_EXTRAS))
def test_a_client_that_leaves_as_its_request_ends(served, route):
    """Three tokens a choice: the request may have ended in the engine by the time the client leaves (before its
    last events and [DONE]); each sequence is still counted once."""
    body = (dict(input="Hello", max_output_tokens=3) if route == "/v1/responses" else
            dict(prompt="Hello", n=2, max_tokens=3, ignore_eos=True) if route == "/v1/completions" else
            dict(messages=MESSAGES, n=2, max_tokens=3, ignore_eos=True))
    sequences = 1 if route == "/v1/responses" else 2
    before = metrics(served.http)
    leave(served, route, {**body, "stream": True, **STREAM_EXTRAS[route]}, after_events=2)
    settle(served, before, sequences)
    still_serves(served)


def test_a_client_that_leaves_before_its_body_is_whole(served):
    route, body, _ = CASES["completions"]
    before = metrics(served.http)
    leave(served, route, body, body_cut=True)
    settle(served, before, 0)
    still_serves(served)


def test_an_httpx_stream_closed_early(served):
    route, body, sequences = CASES["chat"]
    before = metrics(served.http)
    with httpx.Client(base_url=served.url, timeout=60) as client, \
            client.stream("POST", route, json={"model": MODEL, **body, "stream": True}) as response:
        for number, _ in enumerate(response.iter_lines()):
            if number == 6:
                break
    settle(served, before, sequences)
    still_serves(served)
