"""The KV connector hooks (engine/kv_connector.py): the core imports no connector; the scheduler's load,
save and in-flight bookkeeping in-process against a stand-in connector; and, on one real consumer server,
slow producers (one answers its pull after 5 s, one meets and then sends its KV only after 5 s) delay
their own requests only: the other streams' tokens keep coming.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest
import torch
import torch.distributed as dist

from kvshard.config import SchedulerConfig
from kvshard.engine.kv_connector import KVConnectorBase, create_kv_connector, register_kv_connector
from kvshard.engine.scheduler import Scheduler
from kvshard.engine.sequence import Sequence, SequenceStatus
from kvshard.errors import ConfigError
from kvshard.kv.block_pool import BlockPool
from kvshard.kv.layout import DCPLayout
from kvshard.sampling_params import SamplingParams, StructuredOutputsParams
from test_imports import import_graph

# --- the core imports no connector ----------------------------------------------------------------

CORE = ("kvshard.engine", "kvshard.kv")


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module `start` imports, directly or not -> the module that imports it (to name the path)."""
    seen, todo = {start: ""}, [start]
    while todo:
        module = todo.pop()
        for target in graph.get(module, ()):
            if target not in seen:
                seen[target] = module
                todo.append(target)
    return seen


def test_the_core_imports_nothing_from_disagg():
    graph = import_graph()
    core = [m for m in graph if any(m == c or m.startswith(c + ".") for c in CORE)]
    assert "kvshard.engine.scheduler" in core and "kvshard.kv.block_pool" in core
    for module in core:
        seen = reachable(graph, module)
        leaked = sorted(m for m in seen if m == "kvshard.disagg" or m.startswith("kvshard.disagg."))
        if leaked:
            path, at = [leaked[0]], leaked[0]
            while seen[at]:
                at = seen[at]
                path.append(at)
            pytest.fail(f"{module} imports {leaked[0]}: " + " <- ".join(path))


def test_a_connector_is_chosen_by_its_registered_name():
    register_kv_connector("Stand-in", StandIn)
    assert isinstance(create_kv_connector("Stand-in"), StandIn)
    with pytest.raises(ConfigError, match="'Nixl' is not available"):
        create_kv_connector("Nixl")


# --- the scheduler's hooks, in-process ----------------------------------------------------------------

BLOCK = 4


class StandIn(KVConnectorBase):
    """Loads the prompt (all but its last token) of requests whose params ask for it; keeps the blocks of
    requests that ask for it; the test says when each load and save is over."""

    def __init__(self) -> None:
        self.started: dict[int, tuple[list[int], int]] = {}
        self.aborted: list[int] = []
        self.kept: list[int] = []
        self.loaded: dict[int, str | None] = {}
        self.saved: list[int] = []

    def get_num_external_tokens(self, seq: Sequence) -> int:
        return seq.num_tokens - 1 if (seq.params.kv_transfer_params or {}).get("load") else 0

    def start_load(self, seq, blocks, num_tokens) -> None:
        self.started[seq.seq_id] = (list(blocks), num_tokens)

    def abort_load(self, seq) -> None:
        self.aborted.append(seq.seq_id)

    def request_finished(self, seq) -> bool:
        if (seq.params.kv_transfer_params or {}).get("save"):
            self.kept.append(seq.seq_id)
            return True
        return False

    def get_finished(self):
        loaded, self.loaded = self.loaded, {}
        saved, self.saved = self.saved, []
        return loaded, saved


def scheduler(num_blocks: int = 16, max_num_seqs: int = 4) -> tuple[Scheduler, StandIn]:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64)
    s = Scheduler(config, BlockPool(num_blocks), DCPLayout(BLOCK, 1, 1), enable_prefix_caching=False)
    s.connector = StandIn()
    return s, s.connector


def request(num_tokens: int, **transfer) -> Sequence:
    return Sequence(uuid.uuid4().hex, 0, list(range(1, num_tokens + 1)), SamplingParams(
        max_tokens=4, kv_transfer_params=transfer or None), None)


def test_a_load_reserves_the_whole_prompt_then_runs_with_the_loaded_tokens_computed():
    s, c = scheduler()
    local, remote = request(6), request(10, load=True)
    s.add(remote)
    s.add(local)
    batch = s.schedule()
    assert [q.seq_id for q in batch.seqs] == [local.seq_id]  # loading: in no batch
    blocks, num_tokens = c.started[remote.seq_id]
    assert num_tokens == 9 and len(blocks) == 3 and blocks == remote.block_table  # room for all 10 tokens
    assert remote.status is SequenceStatus.WAITING and s.pool.num_used == 2 + 3
    s.mark_computed(batch)
    assert s.update_from_connector() == [] and s.schedule() is None  # still loading (local waits for its token)
    assert remote not in s.running
    c.loaded[remote.seq_id] = None
    assert s.update_from_connector() == []
    batch = s.schedule()
    assert remote in batch.seqs and remote.num_computed_tokens == 9
    assert batch.query_lens[batch.seqs.index(remote)] == 1  # its last prompt token, then it samples
    assert batch.sample[batch.seqs.index(remote)]


def test_a_load_whose_constraint_still_compiles_waits_holding_nothing_and_lets_later_ones_by():
    """A loaded request samples its first token at its next step: its grammar must be there by then. Until it
    compiled, the load does not start (no block reserved, nothing asked of the producer)."""
    s, c = scheduler()
    constrained = Sequence(uuid.uuid4().hex, 0, list(range(1, 11)), SamplingParams(
        max_tokens=4, kv_transfer_params={"load": True}, structured_outputs=StructuredOutputsParams(regex="a+")), None)
    later = request(6, load=True)
    s.add(constrained)
    s.add(later)
    assert constrained.waits_for_grammar
    assert s.schedule() is None
    assert set(c.started) == {later.seq_id} and constrained.block_table == [] and s.pool.num_used == 2
    assert s.has_unfinished()  # the engine keeps stepping (and waiting on the grammar) until it compiled
    constrained.grammar = object()  # what LLMEngine._start_grammars gives it once its grammar compiled
    s.schedule()
    assert c.started[constrained.seq_id] == (constrained.block_table, 9) and s.pool.num_used == 2 + 3


def test_a_failed_load_comes_back_to_the_engine_with_its_blocks_freed():
    s, c = scheduler()
    seq = request(10, load=True)
    s.add(seq)
    assert s.schedule() is None and s.pool.num_used == 3
    c.loaded[seq.seq_id] = "the producer is gone"
    assert s.update_from_connector() == [(seq, "the producer is gone")]
    assert s.pool.num_used == 0 and seq.block_table == []
    s.finish(seq, "error")  # what the engine does with it
    assert seq.is_finished and not s.has_unfinished()


def test_an_aborted_load_frees_its_blocks_only_once_the_connector_is_done_with_them():
    s, c = scheduler()
    seq = request(10, load=True)
    s.add(seq)
    s.schedule()
    s.finish(seq, "abort")
    assert c.aborted == [seq.seq_id] and seq.is_finished
    assert s.pool.num_used == 3  # a transfer may still be writing them
    c.loaded[seq.seq_id] = None
    assert s.update_from_connector() == [] and s.pool.num_used == 0
    assert s.schedule() is None and not s.running


def test_a_load_waits_for_a_sequence_slot_and_blocks_and_lets_later_ones_by():
    s, c = scheduler(num_blocks=4, max_num_seqs=2)
    big, small = request(14, load=True), request(5, load=True)
    s.add(big)  # 4 blocks: all the pool
    s.add(small)
    s.add(request(3))
    s.schedule()
    assert set(c.started) == {big.seq_id}  # small: no block left; the local one: no slot left of 2
    c.loaded[big.seq_id] = "failed"
    [(seq, _)] = s.update_from_connector()
    s.finish(seq, "error")
    s.schedule()
    assert small.seq_id in c.started


def test_a_saved_request_keeps_its_blocks_until_the_connector_says_they_are_sent():
    s, c = scheduler()
    saved, plain = request(6, save=True), request(6)
    s.add(saved)
    s.add(plain)
    s.mark_computed(s.schedule())
    s.finish(saved, "stop")
    s.finish(plain, "length")
    assert c.kept == [saved.seq_id] and saved.is_finished
    assert s.pool.num_used == 2  # the saved one's two blocks
    c.saved.append(saved.seq_id)
    s.update_from_connector()
    assert s.pool.num_used == 0
    aborted = request(6, save=True)
    s.add(aborted)
    s.schedule()
    s.finish(aborted, "abort")  # only a request that finished normally is saved
    assert c.kept == [saved.seq_id] and s.pool.num_used == 0


# --- slow producers delay only their own requests (one real consumer) ---------------------------------

SLOW_S, TRANSFER_TIMEOUT_S = 5.0, 20


@pytest.fixture(scope="module")
def consumer(tmp_path_factory):
    from server_harness import Server

    extra = {"transfer_timeout_s": TRANSFER_TIMEOUT_S, "hold_timeout_s": TRANSFER_TIMEOUT_S}
    server = Server(["kvshard-demo-gqa", "--max-model-len", "256", "--kv-cache-memory", "8MiB", "--block-size",
                     str(BLOCK), "--kv-transfer-config", json.dumps({"kv_role": "kv_consumer",
                                                                      "kv_connector_extra_config": extra})],
                    tmp_path_factory.mktemp("connector") / "consumer.log")
    yield server
    assert server.stop() == 0, server.log


class SlowProducer:
    """Answers a consumer's pull (after `answer_after_s`), with a KV store and layout of its own; with
    `send_after_s`, then meets the consumer in the store at once and sends (zeros) only that long after."""

    def __init__(self, signature: dict, answer_after_s: float = 0.0, send_after_s: float | None = None) -> None:
        from stand_in import Backend

        self.signature, self.send_after_s = signature, send_after_s
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.layout = {"block_size": BLOCK, "dcp": 1, "interleave": 1, "rank_heads": [[0, 1]]}
        self.met_at: float | None = None
        self.sent: bool | None = None
        self.thread: threading.Thread | None = None

        def answer(body: dict):
            time.sleep(answer_after_s)
            blocks = list(range(-(-body["num_tokens"] // BLOCK)))
            ticket, group = uuid.uuid4().hex, f"slow/{uuid.uuid4().hex}"
            if send_after_s is not None:
                self.thread = threading.Thread(target=self._send, args=(body, blocks, ticket, group))
                self.thread.start()
            return 200, {"group_name": group, "store": ["127.0.0.1", self.store.port], "layout": self.layout,
                         "blocks": blocks, "ticket": ticket}

        self.backend = Backend(answer, prefix="/kv_transfer")

    def _send(self, pull: dict, blocks: list[int], ticket: str, group: str) -> None:
        from kvshard.disagg.connector import _layout_from_json
        from kvshard.disagg.transfer import KVTransferPlan, PairGroups, run_transfer
        from kvshard.kv.cache import KVCacheLayer

        self.store.set(f"kvshard-ready/{ticket}/producer", "1")
        self.store.wait([f"kvshard-ready/{ticket}/consumer"])
        self.met_at = time.monotonic()  # the consumer now waits for the KV itself
        time.sleep(self.send_after_s)
        s = self.signature
        dtype = getattr(torch, s["dtype"].removeprefix("torch."))
        caches = [KVCacheLayer(torch.zeros(len(blocks) * BLOCK, s["kv_heads"], s["key_dim"], dtype=dtype),
                               torch.zeros(len(blocks) * BLOCK, s["kv_heads"], s["value_dim"], dtype=dtype),
                               BLOCK, dtype) for _ in range(s["layers"])]
        plan = KVTransferPlan(group, ("127.0.0.1", self.store.port), True, _layout_from_json(self.layout), blocks,
                              _layout_from_json(pull["layout"]), pull["blocks"], pull["num_tokens"],
                              TRANSFER_TIMEOUT_S)
        self.sent = run_transfer(plan, 0, caches, PairGroups(), torch.device("cpu"))

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.join(TRANSFER_TIMEOUT_S + 10)
        self.backend.stop()


def test_slow_producers_delay_only_their_own_requests_while_other_streams_go_on(consumer):
    from kvshard.disagg.secret import HEADER, deployment_secret

    secret = {HEADER: deployment_secret()}
    signature = consumer.http.get("/kv_transfer/info", headers=secret).json()["signature"]
    slow_answer = SlowProducer(signature, answer_after_s=SLOW_S, send_after_s=0.0)  # the pull answered after 5 s
    slow_send = SlowProducer(signature, send_after_s=SLOW_S)  # answered and met at once, the KV sent 5 s later
    answers: dict[str, httpx.Response] = {}
    try:
        for name, producer in (("slow-answer", slow_answer), ("slow-send", slow_send)):
            registered = consumer.http.post("/kv_transfer/register", headers=secret,
                                            json={"engine_id": name, "url": producer.backend.url})
            assert registered.status_code == 200, registered.text

        def fetch(name: str) -> None:
            answers[name] = consumer.http.post("/v1/completions", headers=secret, json={
                "model": "kvshard-demo-gqa", "prompt": "The capital of France is " * 4, "max_tokens": 4,
                "temperature": 0, "ignore_eos": True,
                "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": name, "remote_engine_id": name}})
            answers[name + "-at"] = time.monotonic()

        fetchers = [threading.Thread(target=fetch, args=(name,)) for name in ("slow-answer", "slow-send")]
        for thread in fetchers:
            thread.start()
        deadline = time.monotonic() + 10
        while slow_send.met_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slow_send.met_at is not None, consumer.log  # the consumer is in the transfer now
        # other requests stream, one after another, until both slow requests are answered
        arrivals: list[list[float]] = []
        stop_at = time.monotonic() + SLOW_S + TRANSFER_TIMEOUT_S
        while any(t.is_alive() for t in fetchers) and time.monotonic() < stop_at:
            started, times = time.monotonic(), []
            with consumer.http.stream("POST", "/v1/completions", json={
                    "model": "kvshard-demo-gqa", "prompt": "Hello", "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as streamed:
                assert streamed.status_code == 200
                for line in streamed.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.monotonic())
            arrivals.append([started, *times])
        for thread in fetchers:
            thread.join(TRANSFER_TIMEOUT_S + 10)
    finally:
        slow_answer.stop()
        slow_send.stop()
    # both slow requests took their producer's 5 s, and were answered with their 4 tokens
    for name in ("slow-answer", "slow-send"):
        assert answers[name].status_code == 200, answers[name].text
        assert answers[name].json()["usage"]["completion_tokens"] == 4
    assert slow_send.sent is True
    assert answers["slow-send-at"] - slow_send.met_at >= SLOW_S
    # while they waited, every other stream started and went on at once: no gap near 5 s
    during = [a for a in arrivals if a[0] < answers["slow-send-at"] - 1]
    tokens = sum(len(a) - 1 for a in during)
    gaps = [b - a for stream in arrivals for a, b in zip(stream, stream[1:])]
    assert max(gaps) < 1.0, sorted(gaps)[-5:]
    assert tokens >= 32, arrivals  # at least two whole streams while the slow transfer waited
    assert consumer.wait_for_metric("kvshard:kv_cache_blocks_used", lambda v: v == 0, timeout=10) == 0
