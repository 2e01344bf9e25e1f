"""The HTTP door: what a request may bring (size, content type, choices, prompt length), who may call which
route, and how slowly a client may send (docs/serving.md, "Limits and security").

In process (a tp=1 engine that never runs a step: every request here is refused or answered before it
reaches the engine) for the checks of a request; one real `kvshard serve` (tp=2) for what only a real server
has: its sockets and its read timeouts.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from server_harness import MODEL, Server

API_KEY = "door-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def engine():
    from kvshard.engine.arg_utils import EngineArgs
    from kvshard.engine.llm_engine import LLMEngine

    config = EngineArgs(model=MODEL, max_model_len=MAX_MODEL_LEN, kv_cache_memory="16MiB").create_engine_config()
    engine = LLMEngine(config)
    yield engine
    engine.shutdown()


def make_server(engine, **kwargs):
    from kvshard.entrypoints.openai_server import OpenAIServer

    return OpenAIServer(engine, ["m"], api_key=API_KEY, **kwargs)


@pytest.fixture(scope="module")
def server(engine):
    return make_server(engine)


def call(server, requests, timeout: float = 60):
    """Run `requests(client)` (a coroutine function) against the app in this process, in a thread of its own
    so that a request that reached the engine (which never runs here) fails the test instead of hanging it."""
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://door",
                                     timeout=30) as client:
            return await requests(client)

    result = {}

    def thread() -> None:
        try:
            result["value"] = asyncio.run(run())
        except BaseException as error:
            result["error"] = error

    worker = threading.Thread(target=thread, daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), f"no answer within {timeout} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


# --- body size --------------------------------------------------------------------------------------

def test_a_body_over_the_limit_is_a_413_by_content_length_and_chunked(server):
    big = b'{"model": "m", "prompt": "' + b"many words " * (9 * 2**20 // 11) + b'"}'  # > 9 MiB

    async def chunks():
        for start in range(0, len(big), 2**20):
            yield big[start:start + 2**20]

    async def requests(client):
        json_type = {**AUTH, "content-type": "application/json"}
        declared = await client.post("/v1/completions", content=big, headers=json_type)
        chunked = await client.post("/v1/completions", content=chunks(), headers=json_type)
        return declared, chunked

    declared, chunked = call(server, requests)
    for response in (declared, chunked):
        error = assert_openai_error(response, 413)
        assert "--max-request-body-bytes" in error["message"]


def test_the_body_limit_is_a_setting(engine):
    small = make_server(engine, max_request_body_bytes=1000)
    body = {"model": "m", "prompt": "word " * 400}
    response = call(small, lambda client: client.post("/v1/completions", json=body, headers=AUTH))
    assert_openai_error(response, 413)
    fits = call(small, lambda client: client.post("/v1/completions", json={"model": "nope", "prompt": "x"},
                                                  headers=AUTH))
    assert_openai_error(fits, 404, "model")  # through the door, refused by the route


# --- content type -----------------------------------------------------------------------------------

@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_post_body_that_is_not_declared_json_is_a_415(server, content_type):
    headers = {**AUTH, **({"content-type": content_type} if content_type else {})}
    body = b'{"model": "nope", "prompt": "hello", "max_tokens": 1}'  # a 404 once through the door
    response = call(server, lambda client: client.post("/v1/completions", content=body, headers=headers))
    assert_openai_error(response, 415)


def test_json_with_a_charset_passes_the_door(server):
    response = call(server, lambda client: client.post(
        "/v1/completions", content=b'{"model": "nope", "prompt": "x"}',
        headers={**AUTH, "content-type": "application/json; charset=utf-8"}))
    assert_openai_error(response, 404, "model")


# --- the API key ------------------------------------------------------------------------------------

KEYED = [("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"), ("GET", "/metrics"), ("GET", "/v1/models"),
         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/reset_prefix_cache"),
         ("GET", "/no/such/route")]


def test_every_route_but_health_needs_the_key(server):
    async def requests(client):
        without = [await client.request(method, path) for method, path in KEYED]
        wrong = [await client.request(method, path, headers={"authorization": "Bearer nope"}) for method, path in KEYED]
        health = await client.get("/health")
        with_key = [await client.get(path, headers=AUTH) for path in ("/docs", "/redoc", "/openapi.json", "/metrics")]
        return without + wrong, health, with_key

    refused, health, with_key = call(server, requests)
    for (method, path), response in zip(KEYED * 2, refused):
        assert response.status_code == 401, (method, path, response.status_code)
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert health.status_code == 200
    assert [r.status_code for r in with_key] == [200] * 4


def test_public_metrics_opens_metrics_alone(engine):
    public = make_server(engine, public_metrics=True)

    async def requests(client):
        return await client.get("/metrics"), await client.get("/openapi.json")

    metrics, schema = call(public, requests)
    assert metrics.status_code == 200 and "kvshard" in metrics.text
    assert schema.status_code == 401


# --- what one request may ask for --------------------------------------------------------------------

def test_prompts_times_n_is_capped_naming_the_field(server):
    async def requests(client):
        # max_tokens over max_model_len: were the cap not checked first, a 400 of another kind
        many = await client.post("/v1/completions", json={"model": "m", "prompt": ["a"] * 300,
                                                          "max_tokens": MAX_MODEL_LEN}, headers=AUTH)
        wide = await client.post("/v1/completions", json={"model": "m", "prompt": ["a"] * 3, "n": 100,
                                                          "max_tokens": MAX_MODEL_LEN}, headers=AUTH)
        return many, wide

    many, wide = call(server, requests)
    assert "--max-choices-per-request" in assert_openai_error(many, 400, "prompt")["message"]
    assert "300" in many.json()["error"]["message"]
    assert "300 choices" in assert_openai_error(wide, 400, "n")["message"]


def test_the_choices_cap_is_a_setting(engine):
    narrow = make_server(engine, max_choices_per_request=4)
    response = call(narrow, lambda client: client.post(
        "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 5,
                                      "max_tokens": MAX_MODEL_LEN}, headers=AUTH))
    assert "--max-choices-per-request" in assert_openai_error(response, 400, "n")["message"]


def _health_latencies(client, busy, period: float = 0.05, limit: int = 400):
    """/health asked every `period` s from before `busy` starts until it ends: (the longest wait between two
    answers in s, how many answers came, `busy`'s result)."""
    answered: list[float] = []
    stop = asyncio.Event()

    async def poll() -> None:
        while not stop.is_set() and len(answered) < limit:
            assert (await client.get("/health")).status_code == 200
            answered.append(time.perf_counter())
            await asyncio.sleep(period)

    async def run():
        poller = asyncio.ensure_future(poll())
        while len(answered) < 3:  # the poller runs
            await asyncio.sleep(period)
        try:
            result = await busy
            await asyncio.sleep(2 * period)  # an answer after the end
        finally:
            stop.set()
            await poller
        gaps = [b - a for a, b in zip(answered, answered[1:])]
        return max(gaps), len(answered), result

    return run()


def test_a_huge_prompt_is_refused_before_tokenizing_and_health_never_waits(server):
    huge = "The quick brown fox jumps over the lazy dog. " * (7 * 2**20 // 45)  # ~7 MB, under the body limit

    async def requests(client):
        start = time.perf_counter()
        slowest, count, response = await _health_latencies(
            client, client.post("/v1/completions", json={"model": "m", "prompt": huge}, headers=AUTH))
        elapsed = time.perf_counter() - start
        chat = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": huge}]}, headers=AUTH)
        ids = await client.post("/v1/completions", json={"model": "m", "prompt": [1] * 200_000}, headers=AUTH)
        return slowest, count, elapsed, response, chat, ids

    slowest, count, elapsed, response, chat, ids = call(server, requests)
    assert slowest < 1.0, (slowest, count)  # the longest /health went unanswered (12.6 s when tokenized on the loop)
    assert elapsed < 3.0, elapsed
    assert "characters cannot fit" in assert_openai_error(response, 400, "prompt")["message"]
    assert "characters cannot fit" in assert_openai_error(chat, 400, "messages")["message"]
    assert "200,000 token ids" in assert_openai_error(ids, 400, "prompt")["message"]


@pytest.mark.parametrize("route, field, body", [
    ("/v1/chat/completions", "messages", {"messages": [{"role": "user", "content": ""}] * 250_000}),
    ("/v1/chat/completions", "tools", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f"}}] * 150_000}),
    ("/v1/responses", "input", {"input": [{"role": "user", "content": ""}] * 250_000}),
    ("/v1/completions", "logit_bias", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(300_000)}}),
])
def test_a_large_body_of_too_many_items_is_refused_before_they_are_validated(server, monkeypatch, route, field, body):
    """Each message, input item or tool puts at least a token into the prompt, and logit_bias names token ids:
    more of them than max_model_len (or the vocabulary) is refused from a plain count, before pydantic would
    hold the event loop validating them one by one (a second for 250,000 empty messages)."""
    from kvshard.entrypoints.openai import protocol

    validated = []
    real = protocol.BaseModel.model_validate_json.__func__

    def counting(cls, data, *args, **kwargs):
        validated.append(cls.__name__)
        return real(cls, data, *args, **kwargs)

    monkeypatch.setattr(protocol.BaseModel, "model_validate_json", classmethod(counting))
    payload = protocol.json.dumps({"model": "m", **body}).encode()
    assert len(payload) > protocol.PRESCAN_BODY_BYTES

    async def requests(client):
        return await client.post(route, content=payload, headers={**AUTH, "content-type": "application/json"})

    error = assert_openai_error(call(server, requests), 400, field)
    assert "cannot fit" in error["message"] or "more than the vocabulary" in error["message"], error
    assert validated == []  # refused from the count: nothing validated
    # a small body is validated as before (no count), so the counter above does see validation
    small = protocol.json.dumps({"model": "m", "messages": [{"role": "user", "content": ""}], "max_tokens": 0})

    async def validated_small(client):
        return await client.post("/v1/chat/completions", content=small.encode(),
                                 headers={**AUTH, "content-type": "application/json"})

    assert_openai_error(call(server, validated_small), 400, "max_tokens")
    assert validated == ["ChatCompletionRequest"]


def test_tokenizing_runs_off_the_event_loop(engine):
    """A prompt that takes the tokenizer a while (here: a slowed one, 2.5 s) leaves /health answering."""
    slow = make_server(engine)
    validate = slow.validate_prompt

    def slow_validate(prompt, params):
        time.sleep(2.5)
        return validate(prompt, params)

    slow.validate_prompt = slow_validate

    async def requests(client):
        # refused after tokenizing (prompt + max_tokens over max_model_len), so it never reaches the engine
        body = {"model": "m", "prompt": "hello " * 50, "max_tokens": MAX_MODEL_LEN}
        return await _health_latencies(client, client.post("/v1/completions", json=body, headers=AUTH))

    slowest, count, response = call(slow, requests)
    assert "maximum context length" in assert_openai_error(response, 400, "prompt")["message"]
    # /health kept answering while the tokenizer worked (bounds with room for a loaded machine: on the
    # event loop, /health would wait the whole 2.5 s)
    assert count >= 8, count
    assert slowest < 1.0, slowest  # the longest /health went unanswered


# --- the proxy's door --------------------------------------------------------------------------------

def test_the_proxy_has_the_same_door():
    from kvshard.entrypoints.proxy import Proxy

    proxy = Proxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], max_request_body_bytes=1000)
    with TestClient(proxy.app) as client:
        big = client.post("/v1/completions", json={"model": "m", "prompt": "word " * 400})
        plain = client.post("/v1/completions", content=b'{"model": "m", "prompt": "x"}',
                            headers={"content-type": "text/plain"})
    assert_openai_error(big, 413)
    assert_openai_error(plain, 415)


# --- a real server: sockets and read timeouts --------------------------------------------------------

READ_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    server = Server([MODEL, "--tensor-parallel-size", "2", "--max-model-len", str(MAX_MODEL_LEN),
                     "--kv-cache-memory", "16MiB", "--request-read-timeout", str(READ_TIMEOUT)],
                    tmp_path_factory.mktemp("door") / "log", api_key=API_KEY)
    yield server
    server.stop()


def _address(port: int) -> tuple[str, int]:
    return "127.0.0.1", port


def _connect(server: Server) -> socket.socket:
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(_address(port), timeout=10)
    return sock


def _closed_after(sock: socket.socket, trickle: bytes, limit: float) -> tuple[float | None, bytes]:
    """Send `trickle` a byte every 0.5 s (then nothing) until the server closes: (seconds it took or None, what
    the server answered)."""
    start = time.monotonic()
    answer = b""
    sock.settimeout(0.5)
    sent = 0
    while time.monotonic() - start < limit:
        if sent < len(trickle):
            try:
                sock.send(trickle[sent:sent + 1])
            except OSError:
                return time.monotonic() - start, answer
            sent += 1
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - start, answer
        if not data:
            return time.monotonic() - start, answer
        answer += data
    return None, answer


def test_headers_sent_a_byte_at_a_time_are_cut_off(real_server):
    with _connect(real_server) as sock:
        took, answer = _closed_after(sock, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100, limit=8)
    assert took is not None and took < READ_TIMEOUT + 2, took
    assert answer == b""
    with _connect(real_server) as sock:  # a connection that says nothing at all
        took, _ = _closed_after(sock, b"", limit=8)
    assert took is not None and took < READ_TIMEOUT + 2, took


def test_a_body_sent_a_byte_at_a_time_is_a_408(real_server):
    body = b'{"model": "m", "prompt": "hello", "max_tokens": 1}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with _connect(real_server) as sock:
        sock.sendall(head)
        took, answer = _closed_after(sock, body, limit=10)
    assert took is not None and took < READ_TIMEOUT + 2, took
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer


def test_a_refused_body_is_answered_not_reset_and_the_connection_serves_on(real_server):
    """A refusal that comes before the body (413 by Content-Length, 401, 415) reaches a client still sending it."""
    big = b'{"model": "m", "prompt": "' + b"many words " * (9 * 2**20 // 11) + b'"}'
    with httpx.Client(base_url=real_server.url, timeout=60) as client:
        too_large = client.post("/v1/completions", content=big, headers={**AUTH, "content-type": "application/json"})
        unauthorized = client.post("/v1/completions", content=big[: 2**20] + b'"}',
                                   headers={"content-type": "application/json"})
        plain = client.post("/v1/completions", content=big[: 2**20] + b'"}', headers={**AUTH})
        health = client.get("/health")  # the same connection
    assert_openai_error(too_large, 413)
    assert_openai_error(unauthorized, 401)
    assert_openai_error(plain, 415)
    assert health.status_code == 200


def test_content_length_with_transfer_encoding_is_refused(real_server):
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
               "Content-Type: application/json\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
               "0\r\n\r\n").encode()
    with _connect(real_server) as sock:
        sock.sendall(request)
        took, answer = _closed_after(sock, b"", limit=5)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"Content-Length and Transfer-Encoding" in answer
    assert took is not None  # and the connection is closed


def _listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, local address, port) of every TCP socket in LISTEN that one of `pids` holds (/proc/net/tcp{,6})."""
    inodes: dict[str, int] = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    found = []
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            raw, port = local.split(":")
            packed = bytes.fromhex(raw)
            # /proc writes the address as 32-bit words in host (little-endian) order
            packed = b"".join(packed[i:i + 4][::-1] for i in range(0, size, 4))
            found.append((inodes[inode], str(ipaddress.ip_address(packed)), int(port, 16)))
    return found


def test_no_socket_of_a_running_server_listens_beyond_loopback(real_server):
    pids = [real_server.process.pid, *real_server.rank_pids()]
    assert len(pids) == 2
    listening = _listening_sockets(pids)
    http_port = int(real_server.url.rsplit(":", 1)[1])
    rank0 = [port for pid, _, port in listening if pid == real_server.process.pid]
    assert http_port in rank0 and len(rank0) >= 2, listening  # HTTP and the ranks' rendezvous store at least
    for pid, address, port in listening:
        ip = ipaddress.ip_address(address)
        loopback = ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)
        assert loopback, f"pid {pid} listens on {address}:{port}: {listening}"
    assert real_server.http.get("/health").status_code == 200
