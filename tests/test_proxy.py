"""`kvshard proxy` against stand-in producers and consumers (real HTTP servers that record what they get):
the two requests it makes of each side, round robin over several of each, and errors passed on."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvshard.entrypoints.proxy import Proxy
from stand_in import Backend


@pytest.fixture
def backends():
    started = []

    def start(answer):
        started.append(Backend(answer))
        return started[-1]

    yield start
    for backend in started:
        backend.stop()


def ok(body: dict):
    return 200, {"choices": [{"text": f"from {body['kv_transfer_params'].get('remote_port', 'producer')}"}]}


def test_each_request_prefills_on_a_producer_then_decodes_on_a_consumer_round_robin(backends):
    producers, consumers = [backends(ok), backends(ok)], [backends(ok), backends(ok)]
    with TestClient(Proxy([p.url for p in producers], [c.url for c in consumers]).app) as client:
        answers = [client.post("/v1/completions", json={"model": "m", "prompt": f"p{i}", "max_tokens": 9,
                                                          "stream": False}) for i in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    assert [len(b.bodies) for b in producers + consumers] == [2, 2, 2, 2]
    for i, answer in enumerate(answers):
        producer, consumer = producers[i % 2], consumers[i % 2]
        prefill, decode = producer.bodies[i // 2], consumer.bodies[i // 2]
        assert prefill["prompt"] == decode["prompt"] == f"p{i}"
        assert prefill["max_tokens"] == 1 and decode["max_tokens"] == 9
        assert prefill["kv_transfer_params"]["do_remote_decode"] is True
        params = decode["kv_transfer_params"]
        assert params["do_remote_prefill"] is True
        assert params["transfer_id"] == prefill["kv_transfer_params"]["transfer_id"]
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", producer.port)
        assert answer.json()["choices"][0]["text"] == f"from {producer.port}"  # the consumer's answer


def test_an_error_from_either_side_reaches_the_client_as_it_came(backends):
    refusal = {"error": {"message": "prompt too long", "type": "invalid_request_error", "param": "prompt",
                         "code": None}}
    producer = backends(lambda body: (400, refusal))
    consumer = backends(ok)
    with TestClient(Proxy([producer.url], [consumer.url]).app) as client:
        answer = client.post("/v1/chat/completions", json={"model": "m", "messages": []})
        assert (answer.status_code, answer.json()) == (400, refusal)
        assert consumer.bodies == []  # nothing to decode
        failing = Proxy([backends(ok).url], [backends(lambda body: (500, refusal)).url])
    with TestClient(failing.app) as client:
        assert client.post("/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 500


def test_requests_the_proxy_cannot_split_are_refused(backends):
    with TestClient(Proxy([backends(ok).url], [backends(ok).url]).app) as client:
        several = client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"]})
        assert several.status_code == 400 and several.json()["error"]["param"] == "prompt"
        assert client.post("/v1/completions", json={"model": "m", "prompt": "a", "n": 2}).status_code == 400
        json_type = {"content-type": "application/json"}
        assert client.post("/v1/completions", content=b"{", headers=json_type).status_code == 400
