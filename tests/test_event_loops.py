"""The HTTP side under each event loop uvicorn may run it on: asyncio's, and uvloop's, which uvicorn's default
(`loop="auto"`, as `kvshard serve` leaves it) picks wherever uvloop is installed, as it is beside vLLM.

uvloop's transports are not `asyncio.Transport`s: the server once looked for its connection's transport by that
class, found none under uvloop, and so could not cut the connection of a client that stopped reading (its
request was aborted, but the connection stayed open with what was queued for it). One in-process server per loop
(`kvshard-demo-gqa` at tp=1, `kvshard serve`'s own uvicorn settings, on a thread) and a client that sends a
streaming request and never reads.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from kvshard.engine.arg_utils import EngineArgs
from kvshard.engine.llm_engine import LLMEngine
from kvshard.entrypoints.openai.serving_engine import with_connection_transport
from kvshard.entrypoints.openai_server import OpenAIServer
from kvshard.entrypoints.serve import uvicorn_config
from server_harness import free_local_port, tcp_state, uvicorn_on_a_thread

MODEL = "kvshard-demo-gqa"


@pytest.fixture(params=["asyncio", "uvloop"])
def served(request) -> Iterator[SimpleNamespace]:
    if request.param == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is a test dependency (pyproject.toml's test extra)")
    engine = LLMEngine(EngineArgs.from_kwargs(MODEL, max_model_len=512, kv_cache_memory="64MiB",
                                              max_num_seqs=256).create_engine_config())
    server = OpenAIServer(engine, [MODEL], max_stream_backlog=256)
    port = free_local_port()
    flags = SimpleNamespace(request_read_timeout=30.0, timeout_keep_alive=5, h11_max_incomplete_event_size=None)
    with uvicorn_on_a_thread(uvicorn_config(with_connection_transport(server.app), flags, port=port,
                                            log_level="warning", loop=request.param)) as uv:
        # the loop asked for is the one serving: its listening server's class comes from that loop's module
        assert type(uv.servers[0]).__module__.split(".")[0] == request.param, type(uv.servers[0])
        yield SimpleNamespace(port=port, engine=engine, loop=request.param)


def test_a_client_that_stops_reading_is_aborted_and_its_connection_cut(served):
    # 128 choices with 20 alternatives each: some 100 KB of events a step, which fill the socket buffers of both
    # ends long before 400 steps end the request
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 400, "n": 128, "logprobs": 20,
                       "ignore_eos": True, "stream": True}).encode()
    with socket.socket() as silent:
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        silent.connect(("127.0.0.1", served.port))
        silent.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvshard\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        client_port = silent.getsockname()[1]
        deadline = time.monotonic() + 10
        while not served.engine.requests:
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.01)
        # aborted by its backlog, not ended by max_tokens: the engine lets it go and frees its blocks
        deadline = time.monotonic() + 120
        while served.engine.requests or served.engine.pool.num_used:
            assert time.monotonic() < deadline, "the request of a client that stopped reading was not aborted"
            time.sleep(0.05)
        # and the server's end of the connection is no longer open (reset, not left to trickle out)
        deadline = time.monotonic() + 10
        while (state := tcp_state(served.port, client_port)) == "ESTABLISHED" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state != "ESTABLISHED", f"under {served.loop}, the server kept the connection of a client that " \
                                       "stopped reading open"
    # others are served after it
    answer = httpx.post(f"http://127.0.0.1:{served.port}/v1/completions", timeout=60,
                        json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length", answer.text
