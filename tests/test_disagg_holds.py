"""The producer's holds always end, whatever consumers and the proxy do: a property test over random
sequences of hold / pull / bad pull / meeting or not / transfer ok or failed / timeout / release /
shutdown against the connector in-process (a real BlockPool; threads and transfers stood in for); the pulls a
producer refuses, and how a consumer counts its fetches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshard.disagg.config import KVTransferConfig
from kvshard.disagg.connector import SAME_PROMPT, KVConnector, PullRefused
from kvshard.disagg.params import prompt_digest
from kvshard.kv.block_pool import BlockPool
from kvshard.kv.layout import DCPLayout

BLOCK = 4
LAYOUT = {"block_size": BLOCK, "dcp": 1, "interleave": 1, "rank_heads": [[0, 1]]}
HOLD_S, TRANSFER_S = 60.0, 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_engine(num_blocks: int = 64) -> SimpleNamespace:
    config = SimpleNamespace(
        dcp_layout=DCPLayout(BLOCK, 1, 1),
        model=SimpleNamespace(num_kv_heads=1, dtype=torch.float32, hf_config=SimpleNamespace(vocab_size=128)),
        parallel=SimpleNamespace(tensor_parallel_size=1, decode_context_parallel_size=1),
        kv_cache_spec=SimpleNamespace(num_layers=2, key_dim=16, value_dim=16), kv_cache_dtype="auto")
    return SimpleNamespace(config=config, pool=BlockPool(num_blocks), layout=config.dcp_layout)


class Producer(KVConnector):
    """The connector with its thread starts, store meetings and rank transfers in the test's hands."""

    def __init__(self, engine) -> None:
        self.jobs: list[tuple] = []  # threads not run yet
        self.meet_ok = True
        self.transfer_ok: bool | Exception = True
        config = KVTransferConfig.from_json('{"kv_role": "kv_producer", "kv_connector_extra_config": '
                                            f'{{"hold_timeout_s": {HOLD_S}, "transfer_timeout_s": {TRANSFER_S}}}}}')
        self.clock_ = Clock()
        self.kept: dict = {}
        super().__init__(engine, config, "s" * 32, clock=self.clock_, start_store=False)

    @property
    def store_address(self):
        return "127.0.0.1", 1

    def _spawn(self, target, *args) -> None:
        if target == self._transfer:  # the ranks' transfer: as if over at once
            target(*args)
        else:
            self.jobs.append((target, args))

    def _meet(self, *args) -> None:
        if not self.meet_ok:
            raise TimeoutError("the consumer never came")

    def _on_every_rank(self, plan) -> bool:
        if isinstance(self.transfer_ok, Exception):
            raise self.transfer_ok
        return self.transfer_ok

    # the scheduler's side of the hooks (engine/scheduler.py), on the real pool: a request whose KV the
    # connector keeps holds its blocks until get_finished lists it
    def on_finish(self, seq) -> None:
        seq.seq_id = seq.request_id
        if self.request_finished(seq):
            self.engine.pool.take(seq.block_table)
            self.kept[seq.seq_id] = list(seq.block_table)

    def before_schedule(self) -> list:
        self.between_steps()
        self._give_back()
        return []

    def close(self) -> None:
        super().close()
        self._give_back()

    def _give_back(self) -> None:
        loaded, saved = self.get_finished()
        assert loaded == {}
        for seq_id in saved:
            self.engine.pool.free(self.kept.pop(seq_id))


def prompt_of(num_tokens: int) -> list[int]:
    """The prompt of a held request of `num_tokens` tokens (what the consumer's pull must say it has)."""
    return [7 * i % 128 for i in range(num_tokens)]


def pull_body(connector: Producer, transfer_id: str, num_tokens: int, change: dict | None = None) -> dict:
    blocks = list(range(100, 100 + max(1, -(-num_tokens // BLOCK))))
    body = {"transfer_id": transfer_id, "consumer_id": "c0", "generation": 0, "num_tokens": num_tokens,
            "layout": LAYOUT, "blocks": blocks, "signature": connector.signature,
            "prompt_digest": prompt_digest(prompt_of(num_tokens))}
    body.update(change or {})
    return {k: v for k, v in body.items() if v is not None}


BAD_PULLS = [  # each must be refused, and must leave the hold as it was
    {"consumer_id": None}, {"generation": "x"}, {"generation": -1}, {"num_tokens": 10**6},
    {"layout": {"block_size": 0}}, {"layout": "x"}, {"blocks": ["a"]}, {"blocks": []}, {"signature": {}},
    {"transfer_id": "nobody"}, {"transfer_id": ["x"]}, {"extra": 1}, {"layout": {**LAYOUT, "rank_heads": [[1, 0]]}},
    {"prompt_digest": None}, {"prompt_digest": "0" * 63}, {"prompt_digest": prompt_digest([1, 2, 3])},
]

ops = st.lists(st.one_of(
    st.tuples(st.just("hold"), st.integers(1, 30)),  # a prefill of that many tokens finishes
    st.tuples(st.just("pull"), st.integers(0, 9)),
    st.tuples(st.just("bad_pull"), st.integers(0, 9), st.sampled_from(range(len(BAD_PULLS)))),
    st.tuples(st.just("threads"), st.booleans()),  # the waiting threads end: the consumer came or not
    st.tuples(st.just("step"), st.sampled_from(["ok", "failed", "raises"])),
    st.tuples(st.just("time"), st.sampled_from([1.0, TRANSFER_S, HOLD_S + 1])),
    st.tuples(st.just("release"), st.integers(0, 9)),
    st.tuples(st.just("kill"),),
), max_size=40)


def held_blocks(connector: Producer) -> int:
    return sum(len(h.blocks) for h in connector._holds.values())


@settings(max_examples=200, deadline=None)
@given(ops)
def test_no_sequence_of_events_leaks_a_held_block(ops):
    engine = fake_engine()
    connector = Producer(engine)
    ids: list[str] = []
    for op in ops:
        kind = op[0]
        if kind == "hold":
            tokens = op[1]
            blocks = engine.pool.allocate(-(-tokens // BLOCK))
            transfer_id = f"t{len(ids)}"
            ids.append(transfer_id)
            seq = SimpleNamespace(params=SimpleNamespace(kv_transfer_params={"do_remote_decode": True,
                                                                             "transfer_id": transfer_id}),
                                  request_id=transfer_id, block_table=blocks, num_computed_tokens=tokens,
                                  prompt_token_ids=prompt_of(tokens))
            connector.on_finish(seq)
            engine.pool.free(blocks)  # the request's own reference, as Scheduler.finish drops it
        elif kind in ("pull", "bad_pull") and ids:
            transfer_id = ids[op[1] % len(ids)]
            hold = connector._holds.get(transfer_id)
            before = (hold.claimed if hold else None)
            # a consumer asks for all but the last token; at least one, so that a pull with no blocks is bad
            # (a pull of 0 tokens needs none)
            num_tokens = max(1, hold.num_tokens - 1) if hold else 3
            body = pull_body(connector, transfer_id, num_tokens, BAD_PULLS[op[2]] if kind == "bad_pull" else None)
            try:
                answer = connector.serve_pull(body)
            except PullRefused as refusal:
                assert refusal.status in (400, 404, 409)
                assert (hold.claimed if hold else None) == before  # a refused pull claims nothing
            else:
                assert kind == "pull" and hold is not None and not before and hold.claimed
                assert answer["blocks"] == hold.blocks
        elif kind == "threads":
            connector.meet_ok = op[1]
            jobs, connector.jobs = connector.jobs, []
            for target, args in jobs:
                target(*args)
        elif kind == "step":
            connector.transfer_ok = {"ok": True, "failed": False, "raises": RuntimeError("peer gone")}[op[1]]
            assert connector.before_schedule() == []
        elif kind == "time":
            connector.clock_.now += op[1]
            if connector.has_pending():
                connector.before_schedule()
        elif kind == "release" and ids:
            connector.release(ids[op[1] % len(ids)])
        elif kind == "kill":
            connector.close()
            assert engine.pool.num_used == 0
            return
        # every block in use is a hold's, held once; every hold made has ended or is still there
        assert engine.pool.num_used == held_blocks(connector)
        assert connector.holds_total == sum(connector.freed.values()) + len(connector._holds)
    # whatever happened, time and the threads end every hold: nothing claimed stays claimed
    connector.meet_ok = False
    for target, args in connector.jobs:
        target(*args)
    connector.clock_.now += HOLD_S + TRANSFER_S + 1
    assert connector.has_pending() == bool(connector._holds or connector._ready or connector._dropped
                                           or connector._releases)
    connector.before_schedule()
    assert connector._holds == {} and engine.pool.num_used == 0
    assert connector.holds_total == sum(connector.freed.values())


def test_a_hold_released_before_it_is_made_is_never_made():
    engine = fake_engine()
    connector = Producer(engine)
    connector.release("early")
    connector.before_schedule()
    blocks = engine.pool.allocate(2)
    connector.on_finish(SimpleNamespace(params=SimpleNamespace(kv_transfer_params={
        "do_remote_decode": True, "transfer_id": "early"}), request_id="r", block_table=blocks, num_computed_tokens=8,
        prompt_token_ids=prompt_of(8)))
    engine.pool.free(blocks)
    assert engine.pool.num_used == 0 and connector.freed["released"] == 1


def producer_holding_x() -> tuple[SimpleNamespace, Producer, list[int]]:
    """A producer holding the KV of a 12-token prompt (3 blocks) under transfer id "x"."""
    engine = fake_engine()
    connector = Producer(engine)
    blocks = engine.pool.allocate(3)
    connector.on_finish(SimpleNamespace(params=SimpleNamespace(kv_transfer_params={
        "do_remote_decode": True, "transfer_id": "x"}), request_id="r", block_table=blocks, num_computed_tokens=12,
        prompt_token_ids=prompt_of(12)))
    engine.pool.free(blocks)  # the request's own reference, as Scheduler.finish drops it
    return engine, connector, blocks


@pytest.mark.parametrize("bad", BAD_PULLS[:3])
def test_a_malformed_pull_leaves_the_hold_to_its_timeout(bad):
    """The probe's case: after a bad pull, the hold still ends by its timeout (it used to stay claimed)."""
    engine, connector, blocks = producer_holding_x()
    with pytest.raises(PullRefused):
        connector.serve_pull(pull_body(connector, "x", 11, bad))
    connector.clock_.now += HOLD_S + 1
    assert connector.has_pending()
    connector.before_schedule()
    assert engine.pool.num_used == 0 and connector.freed["timeout"] == 1


@pytest.mark.parametrize("change", ["one token", "longer"])
def test_a_pull_for_another_prompt_is_refused_saying_both_sides_must_tokenize_alike(change):
    """A consumer that rendered or tokenized the request differently (another chat template) asks for KV that is
    not its prompt's: refused, the hold left as it was (its timeout or the proxy's release ends it)."""
    engine, connector, blocks = producer_holding_x()
    theirs = prompt_of(11)
    if change == "one token":
        theirs[5] += 1
        body = pull_body(connector, "x", 11, {"prompt_digest": prompt_digest(theirs)})
    else:  # the consumer's prompt is longer than the one held
        body = pull_body(connector, "x", 13)
    with pytest.raises(PullRefused) as refusal:
        connector.serve_pull(body)
    assert refusal.value.status == 409 and SAME_PROMPT in str(refusal.value)
    assert not connector._holds["x"].claimed
    assert connector.serve_pull(pull_body(connector, "x", 11))["blocks"] == blocks  # its own prompt's pull is served


class Consumer(KVConnector):
    """The consumer's side, its pull threads never started: the test answers each fetch itself."""

    def __init__(self, engine) -> None:
        config = KVTransferConfig.from_json('{"kv_role": "kv_consumer", "kv_connector_extra_config": '
                                            '{"producers": {"p": "http://127.0.0.1:1"}}}')
        super().__init__(engine, config, "s" * 32, start_store=False)

    def _spawn(self, target, *args) -> None:
        pass


@pytest.mark.parametrize("aborted", [False, True])
def test_a_fetch_whose_request_ended_first_counts_as_abandoned_not_failed(aborted):
    """A client that hangs up while its request's KV is on its way ends the fetch: not a transfer failure on the
    consumer's dashboards (kvshard:kv_transfer_fetches_total{result="abandoned"})."""
    connector = Consumer(fake_engine())
    seq = SimpleNamespace(seq_id=1, request_id="r", prompt_token_ids=prompt_of(8), params=SimpleNamespace(
        kv_transfer_params={"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "p"}))
    connector.start_load(seq, [0, 1], 7)
    if aborted:
        connector.abort_load(seq)
    connector._answer(connector._fetches[1], "the producer refused: no KV is held for transfer 't'")
    assert connector.fetches == {"ok": 0, "failed": int(not aborted), "abandoned": int(aborted)}
    assert connector.get_finished()[0] == {1: "the producer refused: no KV is held for transfer 't'"}
