"""Disaggregated serving survives its clients (issue 25): one producer, one consumer (tp=1) and the proxy,
real servers shared by the module, and clients that send what a careful attacker would.

- malformed `kv_transfer_params` are 400s naming the field (403 without the deployment's secret), and
  the consumer's engine serves on;
- the consumer never calls an address a client names; it pulls only from producers it knows;
- a malformed pull leaves the hold to end (timeout), a release ends it at once, all counted in /metrics;
- what the consumer would refuse costs the producer nothing;
- a client that hangs up, streamed or not, aborts the consumer's request;
- a producer that never answers delays only the request that waits for it;
- every socket the two servers listen on is on the loopback address.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from functools import partial
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshard.disagg.params import prompt_digest
from kvshard.disagg.secret import HEADER
from server_harness import Server, free_ports, start_together, stop_all

MODEL = "kvshard-demo-gqa"
SECRET = "security-test-secret-" + uuid.uuid4().hex
API_KEY = "security-test-key"  # the deployment's: both servers, and the proxy's clients
HOLD_TIMEOUT_S, TRANSFER_TIMEOUT_S = 2, 2
COMMON = [MODEL, "--max-model-len", "512", "--kv-cache-memory", "16MiB"]
ENV = {"KVSHARD_KV_TRANSFER_SECRET": SECRET}
BLOCKS_USED = "kvshard:kv_cache_blocks_used"
WITH_SECRET = {HEADER: SECRET}


def role(kv_role: str) -> list[str]:
    extra = {"hold_timeout_s": HOLD_TIMEOUT_S, "transfer_timeout_s": TRANSFER_TIMEOUT_S}
    return ["--kv-transfer-config", json.dumps({"kv_role": kv_role, "kv_connector_extra_config": extra})]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("security")
    producer_port, consumer_port, proxy_port = free_ports(3)
    proxy_args = ["--prefill", f"http://127.0.0.1:{producer_port}", "--decode", f"http://127.0.0.1:{consumer_port}"]
    started = start_together([
        partial(Server, [*COMMON, *role("kv_producer")], tmp / "producer.log", port=producer_port, env=ENV,
                api_key=API_KEY),
        partial(Server, [*COMMON, *role("kv_consumer")], tmp / "consumer.log", port=consumer_port, env=ENV,
                api_key=API_KEY),
        partial(Server, proxy_args, tmp / "proxy.log", port=proxy_port, env=ENV, api_key=API_KEY, subcommand="proxy"),
    ])
    yield started
    _, *codes = stop_all([started[2], started[0], started[1]])
    for server, code in zip(started[:2], codes):
        assert code == 0, server.log


def body(**kwargs) -> dict:
    return {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, **kwargs}


def hold(producer: Server, transfer_id: str) -> None:
    answer = producer.http.post("/v1/completions", headers=WITH_SECRET, json=body(
        max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id}))
    assert answer.status_code == 200, answer.text


def held_prompt_digest(producer: Server, num_tokens: int) -> str:
    """What a consumer's pull says of the first `num_tokens` tokens of `hold`'s prompt."""
    tokens = producer.http.post("/tokenize", json={"model": MODEL, "prompt": body()["prompt"]}).json()["tokens"]
    return prompt_digest(tokens[:num_tokens])


def counter(server: Server, name: str, **labels) -> float:
    """A counter's value; 0 for one the server does not have (yet)."""
    return server.metrics().get((name + "_total", tuple(sorted(labels.items()))), 0)


@pytest.mark.parametrize("params, with_secret, status, param", [
    ({"do_remote_prefill": True, "transfer_id": "t1"}, True, 400, "kv_transfer_params.remote_engine_id"),
    ({"do_remote_prefill": True, "transfer_id": "t1"}, False, 403, "kv_transfer_params"),
    ({"do_remote_prefill": True}, True, 400, "kv_transfer_params.transfer_id"),
    ({"do_remote_prefill": True, "transfer_id": "t1", "remote_host": ["x"]}, True, 400,
     "kv_transfer_params.remote_host"),
    ({"do_remote_prefill": True, "transfer_id": 7, "remote_engine_id": "p"}, True, 400, "kv_transfer_params.transfer_id"),
    ({"do_remote_prefill": "yes", "transfer_id": "t"}, True, 400, "kv_transfer_params.do_remote_prefill"),
    ({"do_remote_decode": True, "transfer_id": "t"}, True, 400, "kv_transfer_params.do_remote_decode"),
    ({"transfer_id": "t"}, True, 400, "kv_transfer_params"),
    ("t1", True, 400, "kv_transfer_params"),
    # without the secret, nothing of the fields' shape is told
    ({}, False, 403, "kv_transfer_params"),
    ({"remote_host": "10.0.0.1"}, False, 403, "kv_transfer_params"),
])
def test_malformed_transfer_params_are_400s_naming_the_field_and_the_consumer_serves_on(servers, params, with_secret,
                                                                                         status, param):
    producer, consumer, proxy = servers
    answer = consumer.http.post("/v1/completions", headers=WITH_SECRET if with_secret else {},
                                json=body(kv_transfer_params=params))
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param
    assert consumer.http.get("/health").status_code == 200
    assert proxy.http.post("/v1/completions", json=body()).status_code == 200
    assert consumer.metric(BLOCKS_USED) == 0


def test_the_consumer_calls_no_address_a_client_names(servers):
    producer, consumer, proxy = servers
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        for params in ({"do_remote_prefill": True, "transfer_id": "t", "remote_host": "127.0.0.1", "remote_port": port},
                       {"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": f"127.0.0.1:{port}"}):
            answer = consumer.http.post("/v1/completions", headers=WITH_SECRET, json=body(kv_transfer_params=params))
            assert answer.status_code == 400, answer.text
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody came
    # the routes that let peers in need the secret, and the API key the servers have
    assert consumer.http.post("/kv_transfer/register", json={"engine_id": "x", "url": f"http://127.0.0.1:{port}"}
                              ).status_code == 403
    assert producer.http.get("/kv_transfer/info").status_code == 403
    assert producer.http.get("/kv_transfer/info", headers=WITH_SECRET).json()["kv_role"] == "kv_producer"
    for server in (producer, consumer):
        with httpx.Client(base_url=server.url, headers=WITH_SECRET) as keyless:
            for method, path in [("GET", "/kv_transfer/info"), ("POST", "/kv_transfer/pull"),
                                 ("POST", "/kv_transfer/release"), ("POST", "/kv_transfer/register"),
                                 ("POST", "/kv_transfer/check/v1/completions")]:
                answer = keyless.request(method, path, json={})
                assert answer.status_code == 401, (path, answer.text)
                assert answer.json()["error"]["code"] == "invalid_api_key"


def test_a_malformed_pull_is_refused_and_the_hold_still_ends_and_a_release_ends_it_at_once(servers):
    producer, consumer, proxy = servers
    transfer_id = uuid.uuid4().hex
    timeouts = counter(producer, "kvshard:kv_transfer_holds_freed", reason="timeout")
    hold(producer, transfer_id)
    assert producer.metric(BLOCKS_USED) > 0
    signature = consumer.http.get("/kv_transfer/info", headers=WITH_SECRET).json()["signature"]
    pull = {"transfer_id": transfer_id, "consumer_id": "c", "generation": 0, "num_tokens": 3, "blocks": [0],
            "layout": {"block_size": 16, "dcp": 1, "interleave": 1, "rank_heads": [[0, 1]]}, "signature": signature,
            "prompt_digest": held_prompt_digest(producer, 3)}
    for bad in ({k: v for k, v in pull.items() if k != "consumer_id"}, {**pull, "generation": "x"},
                {**pull, "blocks": "x"}, {**pull, "layout": {"block_size": -4}}):
        answer = producer.http.post("/kv_transfer/pull", headers=WITH_SECRET, json=bad)
        assert answer.status_code == 400, answer.text
    assert producer.http.post("/kv_transfer/pull", json=pull).status_code == 403  # no secret: not even looked at
    assert producer.metric(BLOCKS_USED) > 0  # still held: nothing was claimed
    assert producer.wait_for_metric(BLOCKS_USED, lambda v: v == 0, timeout=HOLD_TIMEOUT_S + 5) == 0
    assert counter(producer, "kvshard:kv_transfer_holds_freed", reason="timeout") == timeouts + 1
    # the proxy's release (the consumer refused, the client left) frees a hold now, not at its timeout
    transfer_id = uuid.uuid4().hex
    hold(producer, transfer_id)
    start = time.monotonic()
    assert producer.http.post("/kv_transfer/release", headers=WITH_SECRET,
                              json={"transfer_id": transfer_id}).status_code == 200
    assert producer.wait_for_metric(BLOCKS_USED, lambda v: v == 0, timeout=HOLD_TIMEOUT_S) == 0
    assert time.monotonic() - start < HOLD_TIMEOUT_S / 2
    assert counter(producer, "kvshard:kv_transfer_holds_freed", reason="released") >= 1


@pytest.mark.parametrize("change", [{"max_tokens": 0}, {"max_tokens": -1}, {"max_tokens": "10"},
                                    {"max_tokens": 600}, {"temperature": -1}, {"model": "other"}])
def test_what_the_consumer_refuses_costs_the_producer_nothing(servers, change):
    producer, consumer, proxy = servers
    prompt_tokens = counter(producer, "kvshard:prompt_tokens")
    answer = proxy.http.post("/v1/completions", json=body(**change))
    assert answer.status_code in (400, 404), answer.text
    assert "error" in answer.json()
    assert counter(producer, "kvshard:prompt_tokens") == prompt_tokens  # never prefilled
    assert producer.metric(BLOCKS_USED) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_aborts_the_consumer_request(servers, stream):
    producer, consumer, proxy = servers
    aborts = counter(consumer, "kvshard:request_success", finished_reason="abort")
    payload = json.dumps(body(max_tokens=480, ignore_eos=True, stream=stream)).encode()
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        assert consumer.wait_for_metric("kvshard:num_requests_running", lambda v: v == 1, timeout=20) == 1
    # the client hung up mid-generation
    assert consumer.wait_for_metric("kvshard:num_requests_running", lambda v: v == 0, timeout=5) == 0
    assert counter(consumer, "kvshard:request_success", finished_reason="abort") == aborts + 1
    assert consumer.wait_for_metric(BLOCKS_USED, lambda v: v == 0, timeout=5) == 0
    assert producer.wait_for_metric(BLOCKS_USED, lambda v: v == 0, timeout=5) == 0


def stream_arrivals(server) -> tuple[float, list[float]]:
    """When a 48-token stream from `server` started, and when each of its chunks arrived."""
    arrivals, started = [], time.monotonic()
    with server.http.stream("POST", "/v1/completions", json=body(max_tokens=48, ignore_eos=True,
                                                                 stream=True)) as streamed:
        for line in streamed.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    return started, arrivals


def test_a_producer_that_never_answers_delays_only_its_own_request(servers):
    producer, consumer, proxy = servers
    with socket.socket() as silent:  # accepts, then never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        silent.settimeout(10)
        registered = consumer.http.post("/kv_transfer/register", headers=WITH_SECRET, json={
            "engine_id": "silent", "url": f"http://127.0.0.1:{silent.getsockname()[1]}"})
        assert registered.status_code == 200, registered.text
        waiting: dict = {}

        def wait_for_silent() -> None:
            waiting["answer"] = consumer.http.post("/v1/completions", headers=WITH_SECRET, json=body(
                kv_transfer_params={"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "silent"}))
            waiting["at"] = time.monotonic()

        thread = threading.Thread(target=wait_for_silent)
        thread.start()
        connection, _ = silent.accept()  # the consumer's pull is in flight: it will wait TRANSFER_TIMEOUT_S
        with connection:
            started, arrivals = stream_arrivals(consumer)
            finished = time.monotonic()
            thread.join(TRANSFER_TIMEOUT_S + 10)
    assert len(arrivals) >= 10
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert arrivals[0] - started < 1.0  # the other stream neither waited to start
    assert max(gaps) < 1.0, gaps  # nor paused for the silent producer
    assert finished < waiting["at"]  # and it was over before the waiting request gave up
    assert waiting["answer"].status_code == 500
    assert "cannot be reached" in waiting["answer"].json()["error"]["message"]
    assert consumer.wait_for_metric(BLOCKS_USED, lambda v: v == 0, timeout=5) == 0
    assert consumer.http.get("/health").status_code == 200


def test_a_one_token_prompt_through_the_proxy_leaves_no_hold(servers):
    """A consumer loads every prompt token's KV but the last: none of a one-token prompt, so it never pulls. The
    producer makes no hold of it (before: each held a block until its timeout, and a burst held the pool)."""
    producer, consumer, proxy = servers
    made = counter(producer, "kvshard:kv_transfer_holds_made")
    for prompt in ([5], [5, 6]):
        answer = proxy.http.post("/v1/completions", json=body(prompt=prompt))
        assert answer.status_code == 200, answer.text
    assert counter(producer, "kvshard:kv_transfer_holds_made") == made + 1  # the two-token prompt's alone
    assert producer.wait_for_metric(BLOCKS_USED, lambda v: v == 0, timeout=1) == 0  # well within HOLD_TIMEOUT_S


def test_a_constraint_the_consumer_cannot_compile_costs_the_producer_nothing(servers):
    """The consumer's check compiles the request's constraint before the producer prefills: a bad one is the
    consumer's 400 naming the field, and the producer neither prefills nor holds; a good one is served."""
    producer, consumer, proxy = servers
    made, prompts = counter(producer, "kvshard:kv_transfer_holds_made"), counter(producer, "kvshard:prompt_tokens")
    answer = proxy.http.post("/v1/completions", json=body(structured_outputs={"regex": "[unclosed"}))
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == "structured_outputs", answer.text
    assert "could not be compiled" in error["message"]
    assert counter(producer, "kvshard:kv_transfer_holds_made") == made
    assert counter(producer, "kvshard:prompt_tokens") == prompts
    answer = proxy.http.post("/v1/completions", json=body(max_tokens=8, structured_outputs={"choice": ["yes", "no"]}))
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] in ("yes", "no")
    assert counter(producer, "kvshard:kv_transfer_holds_made") == made + 1


def test_a_consumer_whose_prompt_is_not_the_prefilled_one_fails_the_request_saying_so(servers):
    """Two sides that render or tokenize a request differently (another --chat-template on one of them): the
    consumer's first prompt tokens are not those whose KV the producer holds. The producer refuses the pull, so
    the request fails naming the cause instead of answering from another prompt's KV; nothing stays held."""
    producer, consumer, proxy = servers
    assert proxy.http.post("/v1/completions", json=body()).status_code == 200  # the proxy registered the producer
    engine_id = producer.http.get("/kv_transfer/info", headers=WITH_SECRET).json()["engine_id"]
    for theirs in ([5, 6, 7, 8, 12, 10], [5, 6, 7, 8, 9, 10, 11, 12]):  # a token changed; a longer prompt
        transfer_id = uuid.uuid4().hex
        held = producer.http.post("/v1/completions", headers=WITH_SECRET, json=body(
            prompt=[5, 6, 7, 8, 9, 10], max_tokens=1,
            kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id}))
        assert held.status_code == 200, held.text
        answer = consumer.http.post("/v1/completions", headers=WITH_SECRET, json=body(prompt=theirs, kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": transfer_id, "remote_engine_id": engine_id}))
        assert answer.status_code == 500, answer.text
        assert "must render and tokenize a request alike" in answer.json()["error"]["message"]
        released = producer.http.post("/kv_transfer/release", headers=WITH_SECRET, json={"transfer_id": transfer_id})
        assert released.status_code == 200, released.text  # what the proxy does once the consumer failed it
    assert consumer.wait_for_metric(BLOCKS_USED, lambda v: v == 0, timeout=5) == 0
    assert producer.wait_for_metric(BLOCKS_USED, lambda v: v == 0, timeout=5) == 0


def test_a_producer_that_answers_a_byte_at_a_time_fails_the_pull_in_its_timeout(servers):
    """httpx bounds each read; a pull is bounded as a whole: its request fails after TRANSFER_TIMEOUT_S, its
    blocks go back, and the consumer serves on."""
    producer, consumer, proxy = servers
    stop = threading.Event()
    with socket.socket() as trickle:
        trickle.bind(("127.0.0.1", 0))
        trickle.listen(8)

        def serve() -> None:
            connection, _ = trickle.accept()
            with connection:
                connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n")
                while not stop.wait(0.3):
                    try:
                        connection.sendall(b" ")
                    except OSError:
                        return

        threading.Thread(target=serve, daemon=True).start()
        registered = consumer.http.post("/kv_transfer/register", headers=WITH_SECRET, json={
            "engine_id": "trickle", "url": f"http://127.0.0.1:{trickle.getsockname()[1]}"})
        assert registered.status_code == 200, registered.text
        started = time.monotonic()
        answer = consumer.http.post("/v1/completions", headers=WITH_SECRET, json=body(
            kv_transfer_params={"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "trickle"}))
        took = time.monotonic() - started
        stop.set()
    assert answer.status_code == 500 and "within" in answer.json()["error"]["message"], answer.text
    assert took < TRANSFER_TIMEOUT_S + 5, took
    assert consumer.wait_for_metric(BLOCKS_USED, lambda v: v == 0, timeout=5) == 0
    assert consumer.http.get("/health").status_code == 200


def test_a_consumer_that_pulls_and_never_comes_delays_no_stream_on_the_producer(servers):
    producer, consumer, proxy = servers
    transfer_id = uuid.uuid4().hex
    hold(producer, transfer_id)
    info = consumer.http.get("/kv_transfer/info", headers=WITH_SECRET).json()
    answer = producer.http.post("/kv_transfer/pull", headers=WITH_SECRET, json={
        "transfer_id": transfer_id, "consumer_id": "gone", "generation": 0, "num_tokens": 3, "blocks": [0],
        "layout": info["layout"], "signature": info["signature"], "prompt_digest": held_prompt_digest(producer, 3)})
    assert answer.status_code == 200, answer.text  # claimed: the producer now waits for this consumer
    started, arrivals = stream_arrivals(producer)
    assert len(arrivals) >= 10
    assert arrivals[0] - started < 1.0
    assert max(b - a for a, b in zip(arrivals, arrivals[1:])) < 1.0  # its engine never waited for the consumer
    # and the claimed hold ends once the consumer has not come within the hold timeout
    assert producer.wait_for_metric(BLOCKS_USED, lambda v: v == 0, timeout=HOLD_TIMEOUT_S + 5) == 0
    assert counter(producer, "kvshard:kv_transfer_holds_freed", reason="failed") >= 1


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False,
                    allow_infinity=False) | st.text(max_size=12), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
TRANSFER_KEYS = ["do_remote_decode", "do_remote_prefill", "transfer_id", "remote_engine_id", "remote_host",
                 "remote_port", "x"]
TRANSFER_PARAMS = JSON | st.dictionaries(st.sampled_from(TRANSFER_KEYS), JSON | st.booleans() | st.text(
    alphabet="abc-_:.", min_size=1, max_size=8), max_size=5)
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed", "messages", "logprobs"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(params=TRANSFER_PARAMS, fields=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=3),
       chat=st.booleans(), through_proxy=st.booleans())
def test_fuzzed_requests_never_get_a_5xx_nor_hurt_either_side(servers, params, fields, chat, through_proxy):
    producer, consumer, proxy = servers
    request = {"model": MODEL, "max_tokens": 2, **({"messages": [{"role": "user", "content": "hi"}]} if chat
                                                    else {"prompt": "hi"}), **fields}
    if not through_proxy:
        request["kv_transfer_params"] = params
    target = proxy if through_proxy else consumer
    answer = target.http.post("/v1/chat/completions" if chat else "/v1/completions", json=request,
                              headers=WITH_SECRET)
    assert answer.status_code < 500, answer.text
    assert "error" in answer.json() or answer.status_code == 200


def test_after_the_fuzz_both_sides_are_healthy_and_hold_nothing(servers):
    producer, consumer, proxy = servers
    for server in servers:
        assert server.http.get("/health").status_code == 200
    assert proxy.http.post("/v1/completions", json=body()).status_code == 200
    for server in (producer, consumer):
        assert server.wait_for_metric(BLOCKS_USED, lambda v: v == 0, timeout=HOLD_TIMEOUT_S + 5) == 0


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` (and its children) listens on, from /proc."""
    pids = [pid] + [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/stat")
                    if _ppid(p) == pid]
    inodes = set()
    for p in pids:
        for fd in Path(f"/proc/{p}/fd").glob("*"):
            try:
                target = fd.readlink().as_posix()
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                found.append((_address(address, width), int(port, 16)))
    return found


def _ppid(stat: Path) -> int | None:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _address(hex_address: str, width: int) -> str:
    raw = bytes.fromhex(hex_address)
    if width == 8:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def test_every_socket_the_servers_listen_on_is_on_loopback(servers):
    producer, consumer, proxy = servers
    assert proxy.http.post("/v1/completions", json=body()).status_code == 200  # the transfer sockets exist now
    for server in (producer, consumer):
        found = listening_addresses(server.process.pid)
        assert len(found) >= 2, found  # HTTP and the transfer's (and the producer's KV store)
        assert all(address in ("127.0.0.1", "::1") for address, _ in found), found
