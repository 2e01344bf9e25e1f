"""Disaggregated prefill/decode through `kvshard proxy`: the answers equal one colocated server's,
whatever the two sides' layouts, and no KV block leaks when a side fails.

One pair of servers (producer, consumer) and a proxy per layout pair, started together (while the
pair before it is checked) and shared by that pair's checks; a colocated tp=1 server per model is the
reference.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import pytest
import torch.distributed
from fastapi.testclient import TestClient

from kvshard.disagg.params import prompt_digest
from kvshard.disagg.secret import HEADER, deployment_secret
from kvshard.entrypoints.proxy import Proxy
from kvshard.models.demo import DEMO_CONFIGS, build_demo_model
from server_harness import Server, free_ports, start_together, stop_all
from stand_in import Backend

BLOCKS_USED = "kvshard:kv_cache_blocks_used"
# The fault pairs' servers (FAULT_PAIRS) start with these, and the fault checks wait them out; a single request's
# own waits under them (its hold until the consumer's pull, the two sides' meeting) take a fraction of a second.
HOLD_TIMEOUT_S, TRANSFER_TIMEOUT_S = 2, 2
PROMPTS = [f"Request {i}: " + "Decode context parallelism shards the key value cache. " * i + "The capital of"
           for i in range(4)]  # 5 to 40 tokens: within one block and across several on every layout
COMMON = ["--max-model-len", "256", "--kv-cache-memory", "8MiB"]

# (model, producer flags, consumer flags): the layout pairs the transfer must relayout between
PAIRS = {
    "tp2-dcp1_to_tp2-dcp2": ("kvshard-demo-gqa", ["-tp", "2", "--block-size", "4"],
                             ["-tp", "2", "--dcp", "2", "--block-size", "4"]),
    "tp1_to_tp4-dcp4-i16": ("kvshard-demo-gqa", ["--block-size", "16"],
                            ["-tp", "4", "--dcp", "4", "--dcp-kv-interleave-size", "16", "--block-size", "16"]),
    "tp2-dcp2-i1_to_tp2-dcp2-i16": ("kvshard-demo-gqa", ["-tp", "2", "--dcp", "2", "--block-size", "16"],
                                    ["-tp", "2", "--dcp", "2", "--dcp-kv-interleave-size", "16",
                                     "--block-size", "16"]),
    "mla_tp1_to_tp2-dcp2": ("kvshard-demo", ["--block-size", "4"], ["-tp", "2", "--dcp", "2", "--block-size", "4"]),
    # two KV heads: split over the consumer's ranks, or merged from two producer ranks onto one
    "gqa2_tp1_to_tp4-dcp2-i2": ("gqa2", ["--block-size", "4"],
                                ["-tp", "4", "--dcp", "2", "--dcp-kv-interleave-size", "2", "--block-size", "8"]),
    "gqa2_tp2_to_tp1": ("gqa2", ["-tp", "2", "--block-size", "8"], ["--block-size", "4"]),
}
FIRST_PAIR = next(iter(PAIRS))
# the deployment's secret: servers and proxies started here read the same per-user file (disagg/secret.py)
WITH_SECRET = {HEADER: deployment_secret()}
# What a producer does when its KV is never fetched, or the transfer never starts, depends on its own
# ranks, not on the consumer's layout nor the head count: one pair per producer layout (tp=2; tp=2,
# dcp=2; tp=1 with MLA) runs those faults. The gqa2 pairs' producers (tp=1, tp=2) are layouts of these.
FAULT_PAIRS = [FIRST_PAIR, "tp2-dcp2-i1_to_tp2-dcp2-i16", "mla_tp1_to_tp2-dcp2"]
# Many requests at once queue their transfers from one producer, each waiting (within the timeouts) for the ones
# before it: the concurrent check runs on a pair started with kvshard's default timeouts, as are all pairs but the
# fault pairs (where a hold that no fetch frees would also outlast the checks' waits for the blocks to come back).
CONCURRENT_PAIR = "tp1_to_tp4-dcp4-i16"


def role(kv_role: str, short_timeouts: bool = True) -> list[str]:
    """--kv-transfer-config for `kv_role`: with the fault checks' HOLD_TIMEOUT_S and TRANSFER_TIMEOUT_S, or
    kvshard's defaults."""
    extra = {"hold_timeout_s": HOLD_TIMEOUT_S, "transfer_timeout_s": TRANSFER_TIMEOUT_S} if short_timeouts else {}
    return ["--kv-transfer-config", json.dumps({"kv_role": kv_role, "kv_connector_extra_config": extra})]


def start_proxy(port: int, prefill: list[str], decode: list[str], log_path) -> Server:
    """`kvshard proxy` between the servers at these URLs; healthy once they are."""
    return Server(["--prefill", *prefill, "--decode", *decode], log_path, port=port, subcommand="proxy")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, list[str]]:
    """The MODEL argument of each model served: the demo models, and a GQA checkpoint with 2 KV heads."""
    path = tmp_path_factory.mktemp("gqa2")
    config = DEMO_CONFIGS["kvshard-demo-gqa"]()
    config.num_key_value_heads = 2
    build_demo_model(config, path)
    return {"kvshard-demo-gqa": ["kvshard-demo-gqa"], "kvshard-demo": ["kvshard-demo"],
            "gqa2": [str(path), "--served-model-name", "gqa2"]}


def pairs_in_run_order(request) -> list[str]:
    """The layout pairs of this module's selected tests, in the order they run."""
    return list(dict.fromkeys(item.callspec.params["pair"] for item in request.session.items
                              if item.module is request.module
                              and "pair" in getattr(getattr(item, "callspec", None), "params", {})))


class Reference:
    """A colocated reference server (its start a Future: waited for on first use). What it answered to a request is
    kept: the pairs that serve the same model compare with the one answer (greedy and deterministic: asking again
    gives the same)."""

    def __init__(self, start: Future) -> None:
        self.start = start
        self._answers: dict[tuple, object] = {}
        self._lock = threading.Lock()

    @property
    def server(self) -> Server:
        return self.start.result()

    def _once(self, key: tuple, ask: Callable[[], object]):
        with self._lock:
            if key in self._answers:
                return self._answers[key]
        answer = ask()
        with self._lock:
            return self._answers.setdefault(key, answer)

    def complete(self, model: str, prompt: str, **kwargs) -> dict:
        return self._once(("complete", model, prompt, json.dumps(kwargs, sort_keys=True)),
                          lambda: complete(self.server, model, prompt, **kwargs))

    def stream(self, model: str, path: str, body: dict) -> str:
        return self._once(("stream", model, path, json.dumps(body, sort_keys=True)),
                          lambda: stream(self.server, model, path, body))

    def post(self, path: str, body: dict) -> dict:
        def ask() -> dict:
            answer = self.server.http.post(path, json=body)
            assert answer.status_code == 200, answer.text
            return answer.json()

        return self._once(("post", path, json.dumps(body, sort_keys=True)), ask)


@pytest.fixture(scope="module")
def references(request, models, tmp_path_factory) -> Iterator[dict[str, Reference]]:
    """The colocated tp=1 reference server of each model, started in the background one after the other in the
    order of the pairs that use them: the first one alongside the first pair, the others while pairs are checked."""
    tmp = tmp_path_factory.mktemp("reference")
    order = list(dict.fromkeys(PAIRS[name][0] for name in pairs_in_run_order(request)))
    with ThreadPoolExecutor(1) as pool:
        starts = {model: pool.submit(Server, [*models[model], *COMMON], tmp / f"{model}.log") for model in order}
        yield {model: Reference(start) for model, start in starts.items()}
        started = [start.result() for start in starts.values() if start.exception() is None]
    for server, code in zip(started, stop_all(started)):
        assert code == 0, server.log


def start_pair(name: str, models: dict[str, list[str]], tmp: Path) -> tuple[Server, Server, Server]:
    """(producer, consumer, proxy) of a layout pair, started together."""
    model, producer_flags, consumer_flags = PAIRS[name]
    fault = name in FAULT_PAIRS
    # the proxy starts with the servers (its startup is mostly imports), on ports chosen for them here
    producer_port, consumer_port, proxy_port = free_ports(3)
    producer_url, consumer_url = f"http://127.0.0.1:{producer_port}", f"http://127.0.0.1:{consumer_port}"
    producer, consumer, proxy = start_together([
        partial(Server, [*models[model], *COMMON, *producer_flags, *role("kv_producer", fault)], tmp / "producer.log",
                port=producer_port),
        partial(Server, [*models[model], *COMMON, *consumer_flags, *role("kv_consumer", fault)], tmp / "consumer.log",
                port=consumer_port),
        partial(start_proxy, proxy_port, [producer_url], [consumer_url], tmp / "proxy.log"),
    ])
    assert (producer.url, consumer.url) == (producer_url, consumer_url)
    return producer, consumer, proxy


def start_doomed(model_args: list[str], tmp: Path) -> Server:
    """A producer for a test to kill (`doomed`): tp=1."""
    return Server([*model_args, *COMMON, "--block-size", "4", *role("kv_producer")], tmp / "doomed.log")


class PairStarts:
    """pair(name) -> its started (producer, consumer, proxy). The next two pairs in the run's order start in the
    background, one after the other, while a pair is checked: the fault checks mostly wait on the hold and
    transfer timeouts, and a pair without them is checked in about the time one pair takes to start. At most
    three pairs' servers are up at once. doomed(name) -> the producer a test of that pair kills, started in the
    background once its pair is handed out."""

    def __init__(self, order: list[str], doomed_for: set[str], models: dict[str, list[str]], tmp_path_factory) -> None:
        self.order, self.doomed_for, self.models, self.tmp_path_factory = order, doomed_for, models, tmp_path_factory
        self.pool, self.side = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
        self.starts: dict[str, Future] = {}
        self.doomed_starts: dict[str, Future] = {}

    def _submit(self, name: str) -> None:
        if name not in self.starts:
            self.starts[name] = self.pool.submit(start_pair, name, self.models, self.tmp_path_factory.mktemp(name))

    def _submit_doomed(self, name: str) -> None:
        if name not in self.doomed_starts:
            self.doomed_starts[name] = self.side.submit(start_doomed, self.models[PAIRS[name][0]],
                                                        self.tmp_path_factory.mktemp(f"{name}-doomed"))

    def pair(self, name: str) -> tuple[Server, Server, Server]:
        self._submit(name)
        servers = self.starts.pop(name).result()
        if name in self.doomed_for:
            self._submit_doomed(name)
        if name in self.order:
            for ahead in self.order[self.order.index(name) + 1 : self.order.index(name) + 3]:
                self._submit(ahead)
        return servers

    def doomed(self, name: str) -> Server:
        self._submit_doomed(name)
        return self.doomed_starts.pop(name).result()

    def close(self) -> None:
        self.pool.shutdown()
        self.side.shutdown()
        # started ahead for tests that did not run (a failure with -x)
        for start in [*self.starts.values(), *self.doomed_starts.values()]:
            if start.exception() is None:
                result = start.result()
                stop_all(list(result) if isinstance(result, tuple) else [result])


@pytest.fixture(scope="module")
def pair_starts(request, models, references, tmp_path_factory) -> Iterator[PairStarts]:
    doomed_for = {item.callspec.params["pair"] for item in request.session.items
                  if item.module is request.module and "doomed" in item.fixturenames}
    starts = PairStarts(pairs_in_run_order(request), doomed_for, models, tmp_path_factory)
    yield starts
    starts.close()


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request, pair_starts):
    model = PAIRS[request.param][0]
    producer, consumer, proxy = pair_starts.pair(request.param)
    yield request.param, model, producer, consumer, proxy
    _, *codes = stop_all([proxy, producer, consumer])
    for server, code in zip((producer, consumer), codes):
        assert code == 0, server.log


def complete(server: Server, model: str, prompt: str, **kwargs) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, **kwargs}
    answer = server.http.post("/v1/completions", json=body, headers=WITH_SECRET)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def stream(server: Server, model: str, path: str, body: dict) -> str:
    events = []
    with server.http.stream("POST", path, json={"model": model, "temperature": 0, "max_tokens": 8,
                                                "ignore_eos": True, "stream": True, **body}) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert all("error" not in e for e in events), events
    choices = [e["choices"][0] for e in events if e["choices"]]
    return "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)


def register(consumer: Server, engine_id: str, url: str) -> None:
    """What the proxy does: tell the consumer where producer `engine_id` answers pulls."""
    answer = consumer.http.post("/kv_transfer/register", headers=WITH_SECRET, json={"engine_id": engine_id, "url": url})
    assert answer.status_code == 200, answer.text


def blocks_back_to_zero(*servers: Server, timeout: float = 15) -> list[float]:
    return [s.wait_for_metric(BLOCKS_USED, lambda v: v == 0, timeout=timeout) for s in servers]


# --- the answers ----------------------------------------------------------------------------------

def test_greedy_completions_through_the_proxy_equal_a_colocated_server(pair, references):
    name, model, producer, consumer, proxy = pair
    for prompt in PROMPTS:
        got, want = complete(proxy, model, prompt), references[model].complete(model, prompt)
        assert got["text"] == want["text"]
        # the decode side's logprobs rest on the transferred KV: wrong KV moves them far from these
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=2e-3)
    assert blocks_back_to_zero(producer, consumer) == [0, 0]


def test_streamed_completion_and_chat_through_the_proxy_equal_a_colocated_server(pair, references):
    name, model, producer, consumer, proxy = pair
    reference = references[model]
    for path, body in [("/v1/completions", {"prompt": PROMPTS[2]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[1]}]})]:
        assert stream(proxy, model, path, body) == reference.stream(model, path, body)
    chat = {"model": model, "messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 6,
            "temperature": 0}
    assert (proxy.http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]
            == reference.post("/v1/chat/completions", chat)["choices"][0]["message"])
    assert blocks_back_to_zero(producer, consumer) == [0, 0]


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
CONSTRAINED = [  # (route, body): an agent's constrained requests
    ("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 8, "structured_outputs": {"choice": ["alpha", "beta"]}}),
    ("/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 24, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 96,
                              "tools": [WEATHER_TOOL], "tool_choice": "required"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 96,
                              "tools": [WEATHER_TOOL],
                              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
]


def without_call_ids(choice: dict) -> dict:
    """A choice with its tool calls' ids (random for each answer) left out."""
    message = choice.get("message") or {}
    calls = [{k: v for k, v in call.items() if k != "id"} for call in message.get("tool_calls") or []]
    return {**choice, "message": {**message, "tool_calls": calls}} if calls else choice


@pytest.mark.parametrize("pair", [FIRST_PAIR, "mla_tp1_to_tp2-dcp2"], indirect=True)
def test_constrained_answers_through_the_proxy_equal_a_colocated_server(pair, references):
    """Structured outputs and required or named tool calls through the proxy: the consumer samples the first token
    under the constraint, as one server does."""
    name, model, producer, consumer, proxy = pair
    for path, body in CONSTRAINED:
        body = {"model": model, "temperature": 0, **body}
        answer = proxy.http.post(path, json=body)
        assert answer.status_code == 200, answer.text
        got, want = answer.json()["choices"][0], references[model].post(path, body)["choices"][0]
        assert without_call_ids(got) == without_call_ids(want)
        if "choice" in body.get("structured_outputs", {}):
            assert got["text"] in ("alpha", "beta")
        if body.get("tool_choice") == "required":
            assert got["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert blocks_back_to_zero(producer, consumer) == [0, 0]


@pytest.mark.parametrize("pair", [CONCURRENT_PAIR], indirect=True)  # one pair keeps the suite short
def test_16_concurrent_requests_through_the_proxy_equal_one_at_a_time(pair, references):
    name, model, producer, consumer, proxy = pair
    prompts = [f"Question {i}: " + "why shard the cache? " * (i % 5) for i in range(16)]

    async def all_at_once() -> list[str]:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=120) as client:
            answers = await asyncio.gather(*(client.post("/v1/completions", json={
                "model": model, "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                for p in prompts))
        return [a.json()["choices"][0]["text"] for a in answers]

    with ThreadPoolExecutor(1) as pool:  # the reference answers one at a time while the proxy has all 16
        want = pool.submit(lambda: [references[model].complete(model, p, logprobs=None)["text"] for p in prompts])
        got = asyncio.run(all_at_once())
    assert got == want.result()
    assert blocks_back_to_zero(producer, consumer) == [0, 0]


# --- faults ---------------------------------------------------------------------------------------

def prefill_and_hold(producer: Server, model: str, transfer_id: str) -> None:
    """What the proxy asks of a producer: a one-token prefill whose KV stays for a consumer."""
    complete(producer, model, PROMPTS[3], max_tokens=1,
             kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id})


@pytest.mark.parametrize("pair", FAULT_PAIRS, indirect=True)
def test_kv_nobody_fetches_is_freed_after_the_hold_timeout(pair):
    name, model, producer, consumer, proxy = pair
    prefill_and_hold(producer, model, uuid.uuid4().hex)
    assert producer.metric(BLOCKS_USED) > 0
    start = time.monotonic()
    assert blocks_back_to_zero(producer, timeout=HOLD_TIMEOUT_S + 10) == [0]
    assert time.monotonic() - start > HOLD_TIMEOUT_S / 2  # held, then freed by the timeout


@pytest.mark.parametrize("pair", FAULT_PAIRS, indirect=True)
def test_a_consumer_that_dies_mid_transfer_lets_the_producer_free_the_kv(pair, references):
    name, model, producer, consumer, proxy = pair
    transfer_id = uuid.uuid4().hex
    prefill_and_hold(producer, model, transfer_id)
    # a consumer asks for the KV, then never joins the transfer (as if it died right after asking)
    signature = consumer.http.get("/kv_transfer/info", headers=WITH_SECRET).json()["signature"]
    tokens = producer.http.post("/tokenize", json={"model": model, "prompt": PROMPTS[3]}).json()["tokens"]
    answer = producer.http.post("/kv_transfer/pull", headers=WITH_SECRET, json={
        "transfer_id": transfer_id, "consumer_id": "gone", "generation": 0, "num_tokens": 3,
        "layout": {"block_size": 4, "dcp": 1, "interleave": 1, "rank_heads": [[0, 1]]}, "blocks": [0],
        "signature": signature, "prompt_digest": prompt_digest(tokens[:3])})
    assert answer.status_code == 200, answer.text
    assert blocks_back_to_zero(producer, timeout=TRANSFER_TIMEOUT_S + 15) == [0]
    # and the pair still serves
    assert complete(proxy, model, PROMPTS[0])["text"] == references[model].complete(model, PROMPTS[0])["text"]


@pytest.fixture
def doomed(pair, pair_starts) -> Iterator[Server]:
    """A tp=1 producer of the pair's model, the test's to kill (started while the pair's other tests ran)."""
    server = pair_starts.doomed(pair[0])
    yield server
    server.stop()


@pytest.mark.parametrize("pair", [FIRST_PAIR], indirect=True)  # one pair keeps the suite short
def test_a_producer_that_dies_fails_the_request_and_frees_the_consumer_blocks(pair, doomed):
    name, model, producer, consumer, proxy = pair
    transfer_id = uuid.uuid4().hex
    prefill_and_hold(doomed, model, transfer_id)
    port = int(doomed.url.rsplit(":", 1)[1])
    register(consumer, "doomed", doomed.url)
    doomed.process.kill()
    doomed.stop()
    answer = consumer.http.post("/v1/completions", headers=WITH_SECRET, json={
        "model": model, "prompt": PROMPTS[3], "max_tokens": 4, "temperature": 0, "kv_transfer_params": {
            "do_remote_prefill": True, "transfer_id": transfer_id, "remote_engine_id": "doomed"}})
    assert answer.status_code == 500
    assert "cannot be reached" in answer.json()["error"]["message"]
    assert blocks_back_to_zero(consumer) == [0]
    # through the proxy, a dead producer is a 502 in OpenAI's shape
    with TestClient(Proxy([f"http://127.0.0.1:{port}"], [consumer.url]).app) as client:
        proxied = client.post("/v1/completions", json={"model": model, "prompt": "hi"})
    assert proxied.status_code == 502
    assert "prefill server" in proxied.json()["error"]["message"]


@pytest.mark.parametrize("pair", [FIRST_PAIR], indirect=True)
def test_a_producer_that_vanishes_mid_transfer_fails_the_request_and_frees_the_consumer_blocks(pair, references):
    name, model, producer, consumer, proxy = pair
    # a producer that answers the pull, then never joins the transfer (as if it died right after answering)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    vanishing = Backend(lambda body: (200, {
        "group_name": f"vanishing/{uuid.uuid4().hex}", "store": ["127.0.0.1", store.port], "blocks": list(range(16)),
        "layout": {"block_size": 4, "dcp": 1, "interleave": 1, "rank_heads": [[0, 1]]}, "ticket": "t"}),
        prefix="/kv_transfer")
    try:
        register(consumer, "vanishing", vanishing.url)
        answer = consumer.http.post("/v1/completions", headers=WITH_SECRET, json={
            "model": model, "prompt": PROMPTS[3], "max_tokens": 4, "temperature": 0, "kv_transfer_params": {
                "do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "vanishing"}})
    finally:
        vanishing.stop()
    assert answer.status_code == 500
    assert "never came to the transfer" in answer.json()["error"]["message"]
    assert len(vanishing.bodies) == 1
    assert blocks_back_to_zero(consumer) == [0]
    # the consumer's ranks all came back from the failed transfer: the pair still serves
    assert complete(proxy, model, PROMPTS[0])["text"] == references[model].complete(model, PROMPTS[0])["text"]
