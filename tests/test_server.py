"""`kvshard serve` at tp=2, dcp=2, spoken to as an OpenAI server: by the official client, httpx and /metrics.

One server (module-scoped) answers most tests; a second one with a tiny KV budget
shows preemption, a third with room for 1,000-token prompts shows prefix caching
(and runs a small `bench serve` of agentic sessions); the three start together. A
two-"node" torchrun launch shows multi-node serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import time
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kvshard.bench.cli import main as bench_main
from kvshard.bench.cli import model_vocab_size
from kvshard.bench.serve import request_list_digest
from kvshard.bench.workloads import WorkloadSpec
from kvshard.engine.arg_utils import EngineArgs
from server_harness import (API_KEY, MODEL, SERVE_ARGS, Server, serve_command, start_command, start_together,
                            stop_all, tcp_state)

PROMPTS = [f"Request {i}: " + "Decode context parallelism shards the key value cache. " * (i % 4) + "The capital of"
           for i in range(32)]  # 5 to 45 tokens: shorter and longer than one virtual block (2 x 16 tokens)
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> dict[str, Server]:
    """The module's servers by name, started together (their startups overlap) and stopped together:
    `main`; `tight`, with 8 virtual blocks of 2 x 16 tokens (256 tokens in all, one request of
    max_model_len); `cache`, with room for 1,000-token prompts, in blocks of 16."""
    tmp = tmp_path_factory.mktemp("serve")
    tight = [*SERVE_ARGS[:-4], "--max-model-len", "256", "--num-kv-blocks", "8"]
    cache = [*SERVE_ARGS[:-4], "--max-model-len", "1536", "--kv-cache-memory", "16MiB", "--block-size", "16"]
    running = dict(zip(["main", "tight", "cache"], start_together([
        partial(Server, [*SERVE_ARGS, "--served-model-name", MODEL], tmp / "main.log", api_key=API_KEY),
        partial(Server, tight, tmp / "tight.log"),
        partial(Server, cache, tmp / "cache.log", api_key=API_KEY),
    ])))
    yield running
    for server, code in zip(running.values(), stop_all(list(running.values()))):
        assert code == 0, server.log


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers["main"]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def tokenizer(client):
    return AutoTokenizer.from_pretrained(client.models.list().data[0].root)


def complete(client, prompt, max_tokens=8, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, **{**GREEDY, **kwargs})


def stream_text(chunks) -> tuple[str, list]:
    chunks = list(chunks)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


# --- the API --------------------------------------------------------------------------------

def test_models_lists_the_served_name_and_max_model_len(client):
    (model,) = client.models.list().data
    assert model.id == MODEL
    assert model.max_model_len == 512


def test_completion_streamed_equals_completion_in_one_piece(client, tokenizer):
    prompt = "The quick brown fox"
    whole = complete(client, prompt, max_tokens=12)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12

    text, chunks = stream_text(complete(client, prompt, max_tokens=12, stream=True,
                                        stream_options={"include_usage": True}))
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_completion_takes_token_ids_and_counts_them(client, tokenizer):
    ids = tokenizer.encode("Hello, world!")
    by_ids = complete(client, ids)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == complete(client, "Hello, world!").choices[0].text


def test_several_prompts_with_n_choices_stream_as_numbered_choices(client):
    prompts = ["Hello", "The quick brown fox"]
    texts: dict[int, str] = {}
    for chunk in complete(client, prompts, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    alone = [complete(client, p).choices[0].text for p in prompts]
    assert texts == {0: alone[0], 1: alone[0], 2: alone[1], 3: alone[1]}  # greedy: the n choices agree


def test_chat_streamed_equals_chat_in_one_piece(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is DCP?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, **GREEDY)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert whole.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert whole.usage.completion_tokens == 10

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage


def test_n_choices_with_a_seed_are_distinct_and_reproducible(client):
    def sample():
        return client.completions.create(model=MODEL, prompt="Hello", n=3, temperature=1.0, seed=11, max_tokens=8,
                                         extra_body={"ignore_eos": True})

    first, second = sample(), sample()
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in sorted(first.choices, key=lambda c: c.index)] == \
           [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert len({c.text for c in first.choices}) > 1
    assert first.usage.completion_tokens == 24


def test_stop_string_cuts_the_text_streamed_or_not(client):
    # the demo model writes random bytes: take a prompt whose output has 3 plain characters after a few
    for prompt in PROMPTS:
        greedy = complete(client, prompt, max_tokens=16).choices[0].text
        starts = [i for i in range(4, len(greedy) - 3)
                  if greedy[i : i + 3].isprintable() and "\ufffd" not in greedy[i : i + 3]]
        if starts:
            break
    stop = greedy[starts[0] : starts[0] + 3]
    expected = greedy[: greedy.find(stop)]

    cut = complete(client, prompt, max_tokens=16, stop=[stop])
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    text, _ = stream_text(complete(client, prompt, max_tokens=16, stop=stop, stream=True))
    assert text == expected


def test_logprobs_of_greedy_tokens_are_the_top_ones(client):
    completion = complete(client, "Numbers: 0 1 2", max_tokens=5, logprobs=2).choices[0].logprobs
    assert len(completion.tokens) == len(completion.token_logprobs) == len(completion.top_logprobs) == 5
    for chosen, top in zip(completion.token_logprobs, completion.top_logprobs):
        assert chosen <= 0 and chosen == pytest.approx(max(top.values()))

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          logprobs=True, top_logprobs=3, **GREEDY).choices[0].logprobs
    assert len(chat.content) == 5
    for token in chat.content:
        assert len(token.top_logprobs) == 3
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)


# --- continuous batching -------------------------------------------------------------------

def test_32_concurrent_streams_equal_one_at_a_time_and_free_all_kv(server, client):
    one_at_a_time = [complete(client, p).choices[0].text for p in PROMPTS]
    steps_before = server.metric("kvshard:engine_steps_total")
    step_seconds_before = {kind: server.metric("kvshard:engine_step_seconds_total", kind=kind)
                           for kind in ("prefill", "decode")}

    async def stream(aclient, prompt):
        chunks = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY)
        text, usage = "", None
        async for chunk in chunks:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage

    async def all_at_once():
        async with server.async_client() as aclient:
            return await asyncio.gather(*(stream(aclient, p) for p in PROMPTS))

    results = asyncio.run(all_at_once())
    assert [text for text, _ in results] == one_at_a_time
    assert all(usage.completion_tokens == 8 for _, usage in results)
    # batched: far fewer steps than the 32 x 8 a one-at-a-time run takes
    assert server.metric("kvshard:engine_steps_total") - steps_before < 32 * 8 / 4
    for kind in ("prefill", "decode"):  # 32 prompts to prefill, then their decodes
        assert server.metric("kvshard:engine_step_seconds_total", kind=kind) > step_seconds_before[kind]
    assert server.wait_for_metric("kvshard:kv_cache_usage_perc", lambda v: v == 0) == 0
    assert server.metric("kvshard:num_requests_running") == server.metric("kvshard:num_requests_waiting") == 0
    for dcp_rank in ("0", "1"):
        assert server.metric("kvshard:dcp_rank_kv_cache_usage_perc", dcp_rank=dcp_rank) == 0


@pytest.fixture(scope="module")
def tight_server(servers) -> Server:
    return servers["tight"]


def test_workload_beyond_the_kv_budget_completes_with_preemptions_and_same_outputs(server, tight_server):
    prompts = PROMPTS[:8]  # 8 x (prompt + 48) tokens need ~24 virtual blocks; 8 exist

    async def run(target):
        async with target.async_client() as aclient:
            completions = await asyncio.gather(*(
                aclient.completions.create(model=MODEL, prompt=p, max_tokens=48, **GREEDY) for p in prompts))
        return [c.choices[0].text for c in completions]

    assert asyncio.run(run(tight_server)) == asyncio.run(run(server))
    assert tight_server.metric("kvshard:num_preemptions_total") > 0
    assert tight_server.metric("kvshard:kv_cache_usage_perc") == 0


# --- metrics -----------------------------------------------------------------------------------

def test_metrics_count_a_request(server, client):
    before = server.metrics()
    usage = complete(client, "Hello", max_tokens=6).usage
    after = server.metrics()

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before[key]

    assert grew("kvshard:prompt_tokens_total") == usage.prompt_tokens
    assert grew("kvshard:generation_tokens_total") == 6
    assert grew("kvshard:request_success_total", finished_reason="length") == 1
    assert grew("kvshard:time_to_first_token_seconds_count") == 1
    assert grew("kvshard:inter_token_latency_seconds_count") == 5
    assert grew("kvshard:e2e_request_latency_seconds_count") == 1
    for name in ("kvshard:kv_cache_usage_perc", "kvshard:num_requests_running", "kvshard:num_requests_waiting",
                 "kvshard:num_preemptions_total"):
        assert (name, ()) in after


def test_metrics_describe_the_dcp_layout(server):
    info = next(dict(labels) for (name, labels) in server.metrics() if name == "kvshard:dcp_layout_info")
    assert info == {"tp": "2", "dcp": "2", "interleave": "1", "block_size": "16", "cache_dtype": "auto",
                    "num_kv_blocks_per_rank": "4096",
                    "kv_capacity_tokens": str(4096 * 16 * 2), "max_model_len": "512",
                    # 4 layers x 1 KV head x (K + V) x 32 dims x 4 bytes, over dcp=2; 8 query heads split over tp=2
                    "attention_layout": "head-split", "attention_tp": "1", "kv_bytes_per_token_per_rank": "512",
                    "replicated_projection_bytes_per_rank": "0", "dcp_comm_backend": "auto"}


# --- clients that leave ---------------------------------------------------------------------------

def test_client_leaving_mid_stream_aborts_its_request_and_frees_its_blocks(server):
    aborted = server.metric("kvshard:request_success_total", finished_reason="abort")
    generated = server.metric("kvshard:generation_tokens_total")
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(events)
        assert server.metric("kvshard:kv_cache_usage_perc") > 0
        assert server.metric("kvshard:num_requests_running") == 1
    # the connection is closed here, 3 tokens into 400
    assert server.wait_for_metric("kvshard:kv_cache_usage_perc", lambda v: v == 0, timeout=5) == 0
    assert server.metric("kvshard:num_requests_running") == 0
    assert server.metric("kvshard:request_success_total", finished_reason="abort") == aborted + 1
    assert server.metric("kvshard:generation_tokens_total") - generated < 200


def test_client_timing_out_on_a_long_completion_aborts_it(server):
    aborted = server.metric("kvshard:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 400, "ignore_eos": True}  # ~2.5 s here
    with pytest.raises(httpx.ReadTimeout):
        server.http.post("/v1/completions", json=body, timeout=0.3)
    assert server.wait_for_metric("kvshard:request_success_total", lambda v: v == aborted + 1, timeout=5,
                                  finished_reason="abort") == aborted + 1
    assert server.wait_for_metric("kvshard:kv_cache_usage_perc", lambda v: v == 0, timeout=5) == 0


# --- bad requests --------------------------------------------------------------------------------

OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BAD_REQUESTS = {
    # name: (method, path, body (dict, or raw bytes), headers, status, param named in the answer)
    "malformed JSON": ("POST", "/v1/completions", b'{"model": ', {}, 400, None),
    "body not an object": ("POST", "/v1/completions", b"[1, 2]", {}, 400, None),
    "missing model": ("POST", "/v1/completions", {"prompt": "Hello"}, {}, 400, "model"),
    "missing prompt": ("POST", "/v1/completions", {"model": MODEL}, {}, 400, "prompt"),
    "prompt of the wrong type": ("POST", "/v1/completions", {**OK, "prompt": {"text": "Hello"}}, {}, 400, "prompt"),
    "max_tokens not an integer": ("POST", "/v1/completions", {**OK, "max_tokens": "ten"}, {}, 400, "max_tokens"),
    "negative max_tokens": ("POST", "/v1/completions", {**OK, "max_tokens": -1}, {}, 400, "max_tokens"),
    "huge max_tokens": ("POST", "/v1/completions", {**OK, "max_tokens": 10**6}, {}, 400, "prompt"),
    "prompt longer than max_model_len": ("POST", "/v1/completions", {**OK, "prompt": [5] * 600}, {}, 400, "prompt"),
    "empty prompt": ("POST", "/v1/completions", {**OK, "prompt": ""}, {}, 400, "prompt"),
    "token id outside the vocabulary": ("POST", "/v1/completions", {**OK, "prompt": [10**6]}, {}, 400, "prompt"),
    "negative temperature": ("POST", "/v1/completions", {**OK, "temperature": -0.5}, {}, 400, "temperature"),
    "top_p above 1": ("POST", "/v1/completions", {**OK, "top_p": 1.5}, {}, 400, "top_p"),
    "top_p of 0": ("POST", "/v1/completions", {**OK, "top_p": 0}, {}, 400, "top_p"),
    "n of 0": ("POST", "/v1/completions", {**OK, "n": 0}, {}, 400, "n"),
    "n above 128": ("POST", "/v1/completions", {**OK, "n": 1000}, {}, 400, "n"),
    "logprobs above 20": ("POST", "/v1/completions", {**OK, "logprobs": 50}, {}, 400, "logprobs"),
    "empty stop string": ("POST", "/v1/completions", {**OK, "stop": [""]}, {}, 400, "stop"),
    "seed not an integer": ("POST", "/v1/completions", {**OK, "seed": "abc"}, {}, 400, "seed"),
    "seed beyond 64 bits": ("POST", "/v1/completions", {**OK, "seed": 2**64}, {}, 400, "seed"),
    "temperature Infinity": ("POST", "/v1/completions", b'{"model": "%s", "prompt": "Hi", "temperature": Infinity}'
                             % MODEL.encode(), {}, 400, "temperature"),
    "top_p NaN": ("POST", "/v1/completions", b'{"model": "%s", "prompt": "Hi", "top_p": NaN}' % MODEL.encode(), {},
                  400, "top_p"),
    "temperature beyond float": ("POST", "/v1/completions", {**OK, "temperature": 10**400}, {}, 400, "temperature"),
    "top_k beyond int64": ("POST", "/v1/completions", {**OK, "top_k": 2**63}, {}, 400, "top_k"),
    "too many stop strings": ("POST", "/v1/completions", {**OK, "stop": ["x"] * 65}, {}, 400, "stop"),
    "stop token id outside the vocabulary": ("POST", "/v1/completions", {**OK, "stop_token_ids": [10**6]}, {}, 400,
                                             "stop_token_ids"),
    "negative token id": ("POST", "/v1/completions", {**OK, "prompt": [-1]}, {}, 400, "prompt"),
    "best_of other than n": ("POST", "/v1/completions", {**OK, "best_of": 2}, {}, 400, "best_of"),
    "stream_options without stream": ("POST", "/v1/completions", {**OK, "stream_options": {"include_usage": True}},
                                      {}, 400, "stream_options"),
    "penalty out of range": ("POST", "/v1/completions", {**OK, "frequency_penalty": 2.5}, {}, 400,
                             "frequency_penalty"),
    "beam search": ("POST", "/v1/completions", {**OK, "use_beam_search": True}, {}, 400, "use_beam_search"),
    "max_tokens 0 without echo": ("POST", "/v1/completions", {**OK, "max_tokens": 0}, {}, 400, "max_tokens"),
    "unknown model": ("POST", "/v1/completions", {**OK, "model": "gpt-9"}, {}, 404, "model"),
    "wrong API key": ("POST", "/v1/completions", OK, {"Authorization": "Bearer wrong"}, 401, None),
    "no API key": ("GET", "/v1/models", None, {"Authorization": ""}, 401, None),
    "unknown route": ("POST", "/v1/embeddings", OK, {}, 404, None),
    "wrong method": ("GET", "/v1/completions", None, {}, 405, None),
    "chat without messages": ("POST", "/v1/chat/completions", {**CHAT, "messages": []}, {}, 400, "messages"),
    "chat with an unknown role": ("POST", "/v1/chat/completions",
                                  {**CHAT, "messages": [{"role": "wizard", "content": "Hi"}]}, {}, 400, "messages"),
    "chat content of the wrong type": ("POST", "/v1/chat/completions",
                                       {**CHAT, "messages": [{"role": "user", "content": 5}]}, {}, 400, "messages"),
    "chat with tools": ("POST", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, {}, 400, "tools"),
    "chat max_completion_tokens of 0": ("POST", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, {},
                                        400, "max_tokens"),
    "chat top_logprobs without logprobs": ("POST", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, {}, 400,
                                           "top_logprobs"),
    "chat top_logprobs above 20": ("POST", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21},
                                   {}, 400, "top_logprobs"),
    "chat presence_penalty Infinity": ("POST", "/v1/chat/completions",
                                       b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], '
                                       b'"presence_penalty": -Infinity}' % MODEL.encode(), {}, 400, "presence_penalty"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_gets_a_clear_4xx_and_the_server_keeps_serving(server, client, case):
    method, path, body, headers, status, param = case
    content = body if isinstance(body, bytes) else None
    response = server.http.request(method, path, content=content, json=None if content is not None else body,
                                   headers={"content-type": "application/json", **headers} if content else headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert complete(client, "Hello", max_tokens=2).choices[0].finish_reason == "length"


@pytest.mark.parametrize("extreme", [dict(top_p=1e-300), dict(temperature=1e-300),
                                     dict(temperature=1e-45, top_p=5e-324)],
                         ids=["top_p 1e-300", "temperature 1e-300", "both denormal"])
def test_extreme_but_legal_sampling_values_sample_the_top_token(server, client, extreme):
    # such values once made the distribution NaN and killed the engine for everyone
    sampled = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, seed=1, **extreme,
                                        extra_body={"ignore_eos": True})
    assert sampled.choices[0].text == complete(client, "Hello", max_tokens=6).choices[0].text
    assert server.http.get("/health").status_code == 200


# --- a client that stops reading -------------------------------------------------------------------

def test_stream_whose_client_stops_reading_is_aborted_and_frees_its_blocks(server, client):
    aborted = server.metric("kvshard:request_success_total", finished_reason="abort")
    generated = server.metric("kvshard:generation_tokens_total")
    # 128 choices with 20 alternatives each: ~100 KB of events per step, so the socket buffers of both
    # ends (a few MB) fill within tens of steps, long before 400 steps end the request
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 400, "n": 128, "logprobs": 20,
                       "ignore_eos": True, "stream": True}).encode()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as silent:
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        silent.connect((host, int(port)))
        silent.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvshard\r\nContent-Type: application/json\r\n"
                       b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
                       % (API_KEY.encode(), len(body), body))
        client_port = silent.getsockname()[1]
        assert tcp_state(int(port), client_port) == "ESTABLISHED"  # the server's end, as the kernel lists it
        assert server.wait_for_metric("kvshard:num_requests_running", lambda v: v > 0) > 0
        started = time.monotonic()
        # the others are still served while it runs (and after)
        assert complete(client, "Hello", max_tokens=2).choices[0].finish_reason == "length"
        assert server.wait_for_metric("kvshard:request_success_total", lambda v: v == aborted + 128, timeout=120,
                                      finished_reason="abort") == aborted + 128
        aborted_after = time.monotonic() - started
        assert server.wait_for_metric("kvshard:kv_cache_usage_perc", lambda v: v == 0, timeout=5) == 0
        assert server.metric("kvshard:num_requests_running") == server.metric("kvshard:num_requests_waiting") == 0
        # stopped by its backlog, not by max_tokens: fewer than 400 tokens of each of the 128 choices were made
        assert server.metric("kvshard:generation_tokens_total") - generated < 128 * 400
        # the server closed its end of the connection: its socket is no longer ESTABLISHED (what it had queued
        # still trickles through this socket's 4 KB window, which can take minutes, so that is not waited for)
        deadline = time.monotonic() + 10
        while (state := tcp_state(int(port), client_port)) == "ESTABLISHED" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state != "ESTABLISHED", "the server kept the connection of a client that stopped reading open"
    print(f"unread stream aborted {aborted_after:.1f}s after it started, its connection closed by the server "
          f"(its end {state})")
    assert complete(client, "Hello", max_tokens=2).choices[0].finish_reason == "length"


# --- fuzzing the request schema --------------------------------------------------------------------

def _values() -> st.SearchStrategy:
    """Well- and ill-typed JSON values, with the edges of every range a field has."""
    numbers = st.one_of(
        st.integers(-3, 3), st.integers(), st.sampled_from([2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 511, 512]),
        st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from([0.0, 1e-300, 5e-324, 1e-45, 1.0, 1.0000001, 2.0, 1e300, -0.0]),
    )
    scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=8))
    return st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=4), scalars, max_size=2),
                     st.lists(st.integers(-2, 600), min_size=1, max_size=4))


COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "n", "best_of", "temperature", "top_p", "top_k", "seed", "stop",
                     "stop_token_ids", "ignore_eos", "logprobs", "echo", "suffix", "stream", "stream_options",
                     "frequency_penalty", "presence_penalty", "logit_bias", "user", "min_p", "repetition_penalty",
                     "min_tokens", "bad_words", "use_beam_search", "length_penalty"]
CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "top_k",
               "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "stream", "stream_options",
               "frequency_penalty", "presence_penalty", "logit_bias", "add_generation_prompt", "tools",
               "response_format", "user", "min_p", "repetition_penalty", "min_tokens", "bad_words", "best_of"]
NON_FINITE = [b"NaN", b"Infinity", b"-Infinity"]
_short_text = st.text(max_size=6)
# values of each field's own type, at and beyond the edges of its range; short answers only (n, max_tokens small)
WELL_TYPED = {
    "model": st.sampled_from([MODEL, "", "gpt-4"]),
    "prompt": st.one_of(_short_text, st.lists(st.integers(-1, 600), max_size=5),
                        st.lists(_short_text, min_size=1, max_size=2),
                        st.lists(st.lists(st.integers(0, 511)), max_size=2)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                                "content": st.one_of(_short_text, st.none())}), max_size=2),
    "max_tokens": st.one_of(st.integers(-1, 6), st.sampled_from([512, 2**63, 2**64])),
    "max_completion_tokens": st.integers(-1, 6),
    "n": st.one_of(st.integers(-1, 3), st.sampled_from([129, 2**63])),
    "best_of": st.integers(-1, 3),
    "temperature": st.one_of(st.floats(-1, 3), st.sampled_from([0.0, 1e-300, 5e-324, 1e300, 1.7976931348623157e308])),
    "top_p": st.one_of(st.floats(-0.5, 1.5), st.sampled_from([0.0, 1e-300, 5e-324, 1.0, 1.0000000001])),
    "top_k": st.one_of(st.integers(-3, 600), st.sampled_from([2**63 - 1, 2**63])),
    "seed": st.one_of(st.integers(-(2**65), 2**65), st.sampled_from([2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1])),
    "stop": st.one_of(_short_text, st.lists(_short_text, max_size=3)),
    "stop_token_ids": st.lists(st.integers(-1, 600), max_size=3),
    "logprobs": st.one_of(st.integers(-1, 21), st.booleans()),  # an int for completions, a bool for chat
    "top_logprobs": st.integers(-1, 21),
    "frequency_penalty": st.one_of(st.just(0.0), st.floats(-2, 2)),
    "presence_penalty": st.one_of(st.just(0), st.floats(-2, 2)),
    "logit_bias": st.dictionaries(st.sampled_from(["1", "50", "x", "512", "-1"]), st.floats(-101, 101), max_size=2),
    "min_p": st.floats(-0.5, 1.5),
    "repetition_penalty": st.one_of(st.floats(-1, 3), st.just(0.0)),
    "min_tokens": st.integers(-1, 4),
    "bad_words": st.lists(st.one_of(_short_text, st.just("Hi")), max_size=2),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "tools": st.lists(st.just({"type": "function"}), max_size=1),
    "suffix": st.one_of(st.none(), _short_text),
    "user": _short_text,
}


@st.composite
def _requests(draw) -> tuple[str, bytes]:
    """A valid small request with 1 to 3 fields replaced by generated values (maybe NaN or Infinity)."""
    chat = draw(st.booleans())
    path, fields = ("/v1/chat/completions", CHAT_FIELDS) if chat else ("/v1/completions", COMPLETION_FIELDS)
    body = dict(CHAT if chat else OK)
    body["max_tokens"] = 2
    chosen = draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True))
    for name in chosen:
        well_typed = WELL_TYPED.get(name, st.booleans())
        body[name] = draw(st.one_of(well_typed, well_typed, _values()))  # two in three of the field's own type
    raw = json.dumps(body).encode()
    if draw(st.booleans()):  # non-standard JSON numbers that Python's json accepts
        raw = raw.replace(b'"%s": ' % chosen[0].encode(), b'"%s": %s, "_": ' % (chosen[0].encode(),
                                                                             draw(st.sampled_from(NON_FINITE))), 1)
    return path, raw


def test_fuzzed_requests_never_get_a_5xx_nor_hurt_the_engine(server, client):
    reference = complete(client, PROMPTS[3], max_tokens=8).choices[0].text
    requests: list[tuple[str, bytes]] = []
    started = time.monotonic()

    # Hypothesis only draws the requests (derandomized: the same ones every run); they are sent afterwards by
    # several clients at once, so that the engine runs the legal ones in shared steps, as a server's clients do.
    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(_requests())
    # values that once killed the engine or got a 500
    @example(("/v1/completions", json.dumps({**OK, "temperature": 1, "top_p": 1e-300}).encode()))
    @example(("/v1/chat/completions", json.dumps({**CHAT, "temperature": 1e-300}).encode()))
    @example(("/v1/completions", json.dumps({**OK, "seed": 2**64}).encode()))
    def draw(request):
        requests.append(request)

    draw()

    def send(request: tuple[str, bytes]) -> httpx.Response:
        path, raw = request
        return server.http.post(path, content=raw, headers={"content-type": "application/json"}, timeout=60)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, requests))
    seen: dict[int, int] = {}
    for (_, raw), response in zip(requests, answers):
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (raw, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", (raw, response.text)
    print(f"{len(requests)} fuzzed requests, answers by status: {dict(sorted(seen.items()))} "
          f"in {time.monotonic() - started:.1f}s")
    assert len(requests) >= 200
    assert seen.get(200, 0) > 10 and sum(n for code, n in seen.items() if 400 <= code < 500) > 10
    assert server.http.get("/health").status_code == 200
    assert complete(client, PROMPTS[3], max_tokens=8).choices[0].text == reference


# --- prefix caching -------------------------------------------------------------------------------

VIRTUAL_BLOCK = 16 * 2  # block size x dcp: the granularity of a cache hit


@pytest.fixture(scope="module")
def cache_server(servers) -> Server:
    return servers["cache"]


def reset_prefix_cache(server: Server) -> None:
    assert server.http.post("/reset_prefix_cache").status_code == 200
    assert server.metric("kvshard:kv_cache_blocks_cached") == 0


def cached_tokens(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_start_up_report_says_prefix_caching_is_on_in_whole_virtual_blocks(cache_server):
    assert ("Prefix caching: on, a shared prompt prefix is reused in whole virtual blocks of 32 tokens "
            "(block size 16 x dcp 2)") in cache_server.log


def test_start_up_report_says_when_prefix_caching_is_off():
    config = EngineArgs(model=MODEL, tensor_parallel_size=2, decode_context_parallel_size=2,
                        kv_cache_memory="16MiB", max_model_len=512,
                        enable_prefix_caching=False).create_engine_config()
    assert "Prefix caching: off" in config.layout_report()


def test_a_shared_1000_token_prefix_is_reported_cached_and_counted(cache_server):
    client = cache_server.client()
    reset_prefix_cache(cache_server)
    prefix = random.Random(0).choices(range(model_vocab_size(MODEL)), k=1000)
    before = cache_server.metrics()
    first = complete(client, prefix + [1, 2, 3], max_tokens=4)
    assert cached_tokens(first.usage) == 0
    chunks = list(complete(client, prefix + [4, 5, 6], max_tokens=4, stream=True,
                           stream_options={"include_usage": True}))
    second = chunks[-1].usage
    assert second.prompt_tokens == 1003
    # every whole virtual block of the shared 1,000 tokens: 31 x 32
    assert cached_tokens(second) == 1000 // VIRTUAL_BLOCK * VIRTUAL_BLOCK == 992
    after = cache_server.metrics()

    def grew(name: str) -> float:
        return after[(name, ())] - before[(name, ())]

    assert grew("kvshard:prefix_cache_queries_total") == 1003 + 1003
    assert grew("kvshard:prefix_cache_hits_total") == 992
    # the first request's 31 full blocks stay cached (free, reusable); the second's tail block is not full
    assert after[("kvshard:kv_cache_blocks_cached", ())] == 31
    assert after[("kvshard:kv_cache_usage_perc", ())] == 0


def test_chat_reports_cached_tokens_of_a_shared_system_prompt_streamed_or_not(cache_server, tokenizer):
    client = cache_server.client()
    reset_prefix_cache(cache_server)
    system = {"role": "system", "content": "You are a careful coding agent. " * 40}
    conversations = [[system, {"role": "user", "content": question}]
                     for question in ("List the files.", "Run the tests.")]
    first = client.chat.completions.create(model=MODEL, messages=conversations[0], max_tokens=4, **GREEDY)
    assert cached_tokens(first.usage) == 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=conversations[1], max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False) for c in conversations]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert shared > 200
    assert cached_tokens(chunks[-1].usage) == shared // VIRTUAL_BLOCK * VIRTUAL_BLOCK


def test_reset_prefix_cache_makes_the_same_request_compute_its_whole_prompt(cache_server):
    client = cache_server.client()
    prompt = random.Random(1).choices(range(model_vocab_size(MODEL)), k=300)
    complete(client, prompt)
    assert cached_tokens(complete(client, prompt).usage) == 288  # (300 - 1) // 32 x 32: the last token is computed
    assert httpx.post(f"{cache_server.url}/reset_prefix_cache").status_code == 401  # it changes the server: key needed
    reset_prefix_cache(cache_server)
    assert cached_tokens(complete(client, prompt).usage) == 0


def test_bench_serve_sends_agentic_sessions_turn_after_turn_and_reports_cached_tokens(cache_server, tmp_path, capsys):
    workload = ["--workload", "sessions", "--num-turns", "3", "--context-scale", "1/1024", "--output-scale", "1/16",
                "--seed", "3"]
    code = bench_main(["serve", "--base-url", cache_server.url, "--api-key", API_KEY, "--num-prompts", "3",
                       "--max-concurrency", "2", "--metrics-interval", "0.05", "--no-progress",
                       "--result-file", str(tmp_path / "serve.json"), *workload])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "9 requests in 3 sessions" in out and "Turn 3 (3): prompt/cached" in out
    result = json.loads((tmp_path / "serve.json").read_text())
    sessions = WorkloadSpec("sessions", vocab_size=model_vocab_size(MODEL), seed=3, context_scale=1 / 1024,
                            output_scale=1 / 16, num_turns=3).sessions(3)
    assert result["requests_digest"] == request_list_digest([turn for s in sessions for turn in s])
    assert (result["completed"], result["failed"], result["num_sessions"]) == (9, 0, 3)
    assert result["total_output_tokens"] == sum(turn.output_len for s in sessions for turn in s)  # ignore_eos
    # each later turn finds the whole virtual blocks of the previous turn's prompt (the answer inside the
    # prompt is the workload's own tokens, not those generated, so the cache holds no more of it)
    for turn in (1, 2):
        expected = [s[turn - 1].input_len // VIRTUAL_BLOCK * VIRTUAL_BLOCK for s in sessions]
        assert result["turns"][turn]["mean_cached_tokens"] == pytest.approx(sum(expected) / 3)
    assert result["turns"][0]["mean_cached_tokens"] == 0
    assert result["server"]["prefix_cache_hits"] == result["total_cached_tokens"] > 0


# --- multi-node -------------------------------------------------------------------------------------

@contextlib.contextmanager
def torchrun_nodes(tmp_path, args: list[str] = SERVE_ARGS,
                   env: dict[str, str] | None = None) -> Iterator[tuple[Server, subprocess.Popen]]:
    """Two torchrun "nodes" on this machine, one rank each, serving `args` (tp=2, dcp=2): (node 0's server,
    node 1's agent); afterwards nothing of either is left running."""
    from kvshard.engine.executor import free_port

    master_port = free_port()

    def node(rank: int) -> list[str]:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
        return torchrun + serve_command(*args, "--port", "0")[1:]

    # each launcher forks from the suite's forkserver, as the servers do (tests/server_harness.py); its worker,
    # the node's rank, is a subprocess of it
    node1 = start_command(node(1), tmp_path / "node1.log", {**os.environ, **(env or {})})
    node0 = None
    try:
        node0 = Server([], tmp_path / "node0.log", command=node(0), env=env)
        assert "ranks: 2 (tp=2, dcp=2" in node0.log
        yield node0, node1
    finally:
        left = descendants(node1.pid)
        if node0 is not None:
            left += descendants(node0.process.pid)
            node0.stop()
        try:
            node1.wait(30)
        finally:
            node1.kill()
            node1.wait()
        for pid in left:  # a rank its launcher could not end (stopped, say)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in left) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(running(pid) for pid in left), "a rank outlived its node"


def running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_two_torchrun_nodes_serve_what_one_node_serves(server, client, tmp_path):
    with torchrun_nodes(tmp_path) as (node0, node1):
        two_nodes = node0.client()
        for prompt in PROMPTS[:4]:
            assert complete(two_nodes, prompt).choices[0].text == complete(client, prompt).choices[0].text
        # the other node vanishes while the server idles: no local process handle sees it,
        # the idle heartbeat must
        for pid in [node1.pid, *descendants(node1.pid)]:  # the launcher starts its ranks in sessions of their own
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while node0.http.get("/health").status_code == 200:
            assert time.monotonic() < deadline, "an idle server did not notice a lost node within 10 s"
            time.sleep(0.05)
        assert node0.http.get("/health").status_code == 503


STOP_DETECTION_S = 5  # a stopped rank, busy or idle, is noticed within this at the default heartbeat settings


def test_a_torchrun_rank_stopped_mid_stream_fails_the_stream_and_health_within_5_s(tmp_path):
    """Node 1's rank stops (SIGSTOP) while a stream runs: its heartbeat in the rendezvous store stops, and
    rank 0 notices within seconds, not after the 30 s step timeout."""
    defaults = {"KVSHARD_STEP_TIMEOUT": "30", "KVSHARD_HEARTBEAT_TIMEOUT": "3", "KVSHARD_HEARTBEAT_INTERVAL": "0.5"}
    small = [*SERVE_ARGS[:-4], "--max-model-len", "512", "--kv-cache-memory", "4MiB"]
    with torchrun_nodes(tmp_path, small, env=defaults) as (node0, node1):
        (rank1,) = [pid for pid in descendants(node1.pid) if b"torch.distributed.run" not in cmdline(pid)
                    and b"kvshard.entrypoints.cli" in cmdline(pid)]
        flowing = threading.Event()

        def read_stream() -> tuple[int, BaseException | None, float]:
            chunks = 0
            try:
                for _ in node0.client(timeout=60).completions.create(
                        model=MODEL, prompt="Hello", max_tokens=480, stream=True, **GREEDY):
                    chunks += 1
                    if chunks == 3:
                        flowing.set()
            except Exception as error:
                return chunks, error, time.monotonic()
            return chunks, None, time.monotonic()

        with ThreadPoolExecutor(1) as pool:
            reading = pool.submit(read_stream)
            assert flowing.wait(60), "the stream did not start"
            os.kill(rank1, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                health = node0.http.get("/health")
                while health.status_code == 200 and time.monotonic() < stopped_at + STOP_DETECTION_S + 3:
                    time.sleep(0.05)
                    health = node0.http.get("/health")
                health_after = time.monotonic() - stopped_at
                chunks, error, failed_at = reading.result(timeout=60)
            finally:
                os.kill(rank1, signal.SIGKILL)
        stream_after = failed_at - stopped_at
        print(f"torchrun rank stopped, busy: the stream failed after {stream_after:.2f} s, "
              f"/health 503 after {health_after:.2f} s")
        assert error is not None and chunks < 480, "the stream ended normally although a rank was stopped"
        assert "rank 1 stopped answering: no heartbeat for 3 s" in str(error)
        assert health.status_code == 503 and "rank 1 stopped answering" in health.json()["error"]["message"]
        assert stream_after < STOP_DETECTION_S and health_after < STOP_DETECTION_S


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
