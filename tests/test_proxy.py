"""`kvshard proxy` against stand-in producers and consumers (real HTTP servers that record what they get):
the requests it makes of each side, round robin over several of each, the shared secret on every one,
the consumer's check before any prefill, and errors passed on in OpenAI's shape."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvshard.disagg.secret import HEADER
from kvshard.entrypoints.openai.protocol import OUTPUT_CONSTRAINT_FIELDS
from kvshard.entrypoints.proxy import Proxy
from stand_in import Backend

SECRET = "proxy-test-secret-0123456789"


@pytest.fixture
def backends():
    started = []

    def start(answer, producer_id: str | None = None):
        info = {"kv_role": "kv_producer", "engine_id": producer_id} if producer_id else None
        started.append(Backend(answer, prefix="", info=info))
        return started[-1]

    yield start
    for backend in started:
        backend.stop()


def ok(body: dict):
    params = body.get("kv_transfer_params") or {}
    return 200, {"choices": [{"text": f"from {params.get('remote_engine_id', 'producer')}"}]}


def test_each_request_is_checked_prefilled_then_decoded_round_robin_with_the_secret(backends):
    producers = [backends(ok, "p0"), backends(ok, "p1")]
    consumers = [backends(ok), backends(ok)]
    with TestClient(Proxy([p.url for p in producers], [c.url for c in consumers], secret=SECRET).app) as client:
        answers = [client.post("/v1/completions", json={"model": "m", "prompt": f"p{i}", "max_tokens": 9,
                                                          "stream": False}) for i in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    for i, producer in enumerate(producers):  # its engine id once, then a prefill per request
        assert producer.paths == ["/kv_transfer/info", "/v1/completions", "/v1/completions"]
    for consumer in consumers:  # told once where the producer is, then a check and a decode per request
        assert consumer.paths == ["/kv_transfer/register"] + ["/kv_transfer/check/v1/completions",
                                                              "/v1/completions"] * 2
    assert all(h[HEADER] == SECRET for b in producers + consumers for h in b.headers)
    for i, answer in enumerate(answers):
        producer, consumer = producers[i % 2], consumers[i % 2]
        assert consumer.bodies[0] == {"engine_id": f"p{i % 2}", "url": producer.url}
        prefill, check, decode = producer.bodies[i // 2], consumer.bodies[1 + 2 * (i // 2)], consumer.bodies[2 + 2 * (i // 2)]
        assert prefill["prompt"] == decode["prompt"] == f"p{i}" and check == decode
        assert prefill["max_tokens"] == 1 and decode["max_tokens"] == 9
        assert prefill["kv_transfer_params"]["do_remote_decode"] is True
        params = decode["kv_transfer_params"]
        assert params == {"do_remote_prefill": True, "transfer_id": prefill["kv_transfer_params"]["transfer_id"],
                          "remote_engine_id": f"p{i % 2}"}  # never a host or port
        assert answer.json()["choices"][0]["text"] == f"from p{i % 2}"  # the consumer's answer


def test_what_the_consumer_refuses_never_reaches_the_producer(backends):
    refusal = {"error": {"message": "max_tokens must be an integer >= 1, got 0", "type": "invalid_request_error",
                         "param": "max_tokens", "code": None}}
    producer = backends(ok, "p0")
    consumer = backends(lambda body: (200, {}) if "engine_id" in body else (400, refusal))
    with TestClient(Proxy([producer.url], [consumer.url], secret=SECRET).app) as client:
        answer = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 0})
    assert (answer.status_code, answer.json()) == (400, refusal)
    assert producer.paths == ["/kv_transfer/info"]  # no prefill
    assert consumer.paths == ["/kv_transfer/register", "/kv_transfer/check/v1/completions"]


def test_an_error_from_either_side_reaches_the_client_as_it_came(backends):
    refusal = {"error": {"message": "prompt too long", "type": "invalid_request_error", "param": "prompt",
                         "code": None}}
    producer = backends(lambda body: (400, refusal), "p0")
    consumer = backends(ok)
    with TestClient(Proxy([producer.url], [consumer.url], secret=SECRET).app) as client:
        answer = client.post("/v1/chat/completions", json={"model": "m", "messages": []})
        assert (answer.status_code, answer.json()) == (400, refusal)
        assert consumer.paths[-1] == "/kv_transfer/check/v1/chat/completions"  # nothing to decode
        decode_fails = backends(lambda body: (200, {}) if "engine_id" in body or body.get("max_tokens") != 5
                                else (500, refusal))
        failing = Proxy([backends(ok, "p1").url], [decode_fails.url], secret=SECRET)
    with TestClient(failing.app) as client:
        assert client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 5}).status_code == 500


def test_requests_the_proxy_cannot_split_are_refused(backends):
    with TestClient(Proxy([backends(ok, "p0").url], [backends(ok).url], secret=SECRET).app) as client:
        several = client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"]})
        assert several.status_code == 400 and several.json()["error"]["param"] == "prompt"
        assert client.post("/v1/completions", json={"model": "m", "prompt": "a", "n": 2}).status_code == 400
        json_type = {"content-type": "application/json"}
        assert client.post("/v1/completions", content=b"{", headers=json_type).status_code == 400
        own = client.post("/v1/completions", json={"model": "m", "prompt": "a", "kv_transfer_params": {}})
        assert own.status_code == 400 and own.json()["error"]["param"] == "kv_transfer_params"


@pytest.mark.parametrize("body", [
    b'{"model": "m", "prompt": "a", "temperature": NaN}',
    b'{"model": "m", "prompt": "a", "temperature": Infinity}',
    b'{"model": "m", "prompt": "a", "top_p": -Infinity}',
    b'{"model": "m", "prompt": "a", "temperature": 1e400}',
    b'{"model": "m", "prompt": "\\ud800"}',
    b'{"model": "m", "prompt": "a", "stop": ' + b"[" * 60000 + b"]" * 60000 + b"}",
    b'{"model": "m", "prompt": "a", "seed": 1' + b"0" * 5000 + b"}",
    b"[1, 2]",
    b"\xff\xfe",
])
def test_a_body_servers_answer_400_is_a_400_in_openai_s_shape(backends, body):
    producer, consumer = backends(ok, "p0"), backends(ok)
    with TestClient(Proxy([producer.url], [consumer.url], secret=SECRET).app) as client:
        answer = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert producer.bodies == [] and consumer.bodies == []


def test_unknown_routes_and_methods_answer_in_openai_s_shape(backends):
    with TestClient(Proxy([backends(ok, "p0").url], [backends(ok).url], secret=SECRET).app) as client:
        missing, wrong = client.get("/v1/nothing"), client.get("/v1/completions")
    assert missing.status_code == 404 and "error" in missing.json()
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_the_producer_prefills_without_the_output_constraint_the_consumer_samples_under(backends):
    producer, consumer = backends(ok, "p0"), backends(ok)
    constraints = {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"},
                   "guided_json": {"type": "object"}, "guided_regex": "b+", "guided_choice": ["x"],
                   "guided_grammar": "root ::= \"c\""}
    assert set(constraints) == set(OUTPUT_CONSTRAINT_FIELDS)  # every field that asks for one
    tools = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
             "tool_choice": "required"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, **constraints, **tools}
    with TestClient(Proxy([producer.url], [consumer.url], secret=SECRET).app) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    [prefill] = [b for b in producer.bodies if (b.get("kv_transfer_params") or {}).get("do_remote_decode")]
    assert not set(constraints) & set(prefill) and {k: prefill[k] for k in tools} == tools  # tools render the prompt
    check, decode = consumer.bodies[-2:]
    assert {k: decode[k] for k in constraints} == constraints and {k: check[k] for k in constraints} == constraints


@pytest.mark.parametrize("path", ["/v1/responses", "/tokenize", "/detokenize", "/metrics"])
def test_a_server_route_the_proxy_does_not_serve_says_so_and_where_to_go(backends, path):
    producer, consumer = backends(ok, "p0"), backends(ok)
    with TestClient(Proxy([producer.url], [consumer.url], secret=SECRET).app) as client:
        answer = client.post(path, json={"model": "m", "input": "hi", "prompt": "hi"})
    assert answer.status_code == 404, answer.text
    message = answer.json()["error"]["message"]
    assert message.startswith(f"kvshard proxy does not serve {path}: ") and "server" in message
    assert producer.bodies == [] and consumer.bodies == []


def test_a_consumer_that_forgot_the_producer_is_told_again(backends):
    """A consumer restarted since the proxy registered the producer: its check names remote_engine_id."""
    forgot = {"error": {"message": "not a producer this consumer may pull from", "type": "invalid_request_error",
                        "param": "kv_transfer_params.remote_engine_id", "code": None}}
    def consumer_answer(body):
        if "engine_id" in body:
            return 200, {}
        checks = consumer.paths.count("/kv_transfer/check/v1/completions")
        if consumer.paths[-1].startswith("/kv_transfer/check") and checks == 2:
            return 400, forgot  # the 2nd request's first check: it restarted and forgot
        return ok(body)

    producer, consumer = backends(ok, "p0"), backends(consumer_answer)
    with TestClient(Proxy([producer.url], [consumer.url], secret=SECRET).app) as client:
        first = client.post("/v1/completions", json={"model": "m", "prompt": "a"})
        second = client.post("/v1/completions", json={"model": "m", "prompt": "b"})
    assert first.status_code == second.status_code == 200
    assert consumer.paths == ["/kv_transfer/register", "/kv_transfer/check/v1/completions", "/v1/completions",
                              "/kv_transfer/check/v1/completions", "/kv_transfer/register",
                              "/kv_transfer/check/v1/completions", "/v1/completions"]
    assert [p for p in producer.paths if p.startswith("/v1")] == ["/v1/completions"] * 2


def test_a_frozen_upstream_gets_the_proxys_health_a_502_in_bounded_time(monkeypatch):
    """A stopped server's port still accepts connections (the kernel answers for it) and never says a word: the
    proxy's /health, and its quick calls of the transfer routes, give up after their timeout."""
    import socket
    import time

    from kvshard.entrypoints import proxy as proxy_module

    monkeypatch.setattr(proxy_module, "HEALTH_TIMEOUT_S", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with TestClient(Proxy([url], [url], secret=SECRET).app) as client:
            started = time.monotonic()
            answer = client.get("/health")
            took = time.monotonic() - started
    assert answer.status_code == 502 and url in answer.json()["error"]["message"], answer.text
    assert took < 5, took  # without a bound: for ever
