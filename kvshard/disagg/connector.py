"""Rank 0's side of disaggregated prefill/decode: which blocks are held, fetched, and when.

Producer: a request that asks for it (`kv_transfer_params.do_remote_decode`) keeps
its KV blocks when it finishes (one more reference in the pool), under the
transfer id the proxy gave, until a consumer fetches them, the proxy releases
them (the consumer refused the request, or its client left), `hold_timeout_s`
passes, or the producer shuts down. A consumer's pull arrives over HTTP
(`serve_pull`), is checked whole before the hold is claimed, and is answered at
once with the producer's layout, blocks and a ticket; a thread then waits (at
most `transfer_timeout_s`) until the consumer says, in the producer's store under
that ticket, that it is there (as long as an unclaimed hold would wait), and
only then does the engine thread run the send, between two steps. A consumer that never comes costs its hold, never the
engine's time.

Consumer: a request with `kv_transfer_params.do_remote_prefill` leaves the
scheduler's queue for the connector's; a thread asks its producer (known by
engine id: configured in `kv_connector_extra_config.producers`, or registered by
the proxy) and meets it in the store, and between two steps the engine thread
has every rank receive its share into the reserved blocks; the request then joins
the running batch with all prompt tokens but the last computed, so its first step
computes that token and samples the first output token as a colocated engine
would. Pulls run side by side (each claims its hold at once), but a fetch meets
its producer only once the fetch from that producer before it is over, so both
sides run a pair's transfers in the same order. If anything fails, the blocks go back to the pool
and that request alone ends with an error. A preempted request recomputes its
prompt: the producer no longer holds the KV.

Every pool operation and every transfer runs on the engine thread; HTTP, DNS and
store waits run on threads of their own (no network wait inside `LLMEngine.step`
but the transfer itself, once both sides are known to be there).
"""

from __future__ import annotations

import datetime
import logging
import secrets
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import httpx
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from kvshard.disagg.config import KVTransferConfig
from kvshard.disagg.params import PullRequest, first_error
from kvshard.disagg.secret import HEADER
from kvshard.disagg.transfer import KVTransferPlan, PairGroups, bound_store, transfer_on_rank
from kvshard.engine.executor import EngineDeadError
from kvshard.engine.sequence import Sequence, SequenceStatus
from kvshard.kv.layout import DCPLayout
from kvshard.kv.relayout import InstanceLayout, kv_heads_of_ranks
from kvshard.outputs import RequestOutput
from kvshard.parallel import broadcast_from_driver

if TYPE_CHECKING:
    from kvshard.engine.llm_engine import LLMEngine

logger = logging.getLogger("kvshard.disagg")

FREE_REASONS = ("fetched", "failed", "timeout", "released", "shutdown")


class PullRefused(Exception):
    """A consumer asked for KV this producer cannot send (unknown, expired, other model, malformed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Hold:
    blocks: list[int]
    num_tokens: int  # tokens whose KV the blocks hold
    deadline: float
    claimed: bool = False  # a consumer is fetching it: the send (or its failure) frees it, not the timeout


@dataclass
class _Fetch:
    """Consumer: one request's KV on its way here."""

    seq: Sequence
    producer_id: str
    transfer_id: str
    blocks: list[int] = field(default_factory=list)  # reserved once started
    plan: KVTransferPlan | None = None  # set by the thread once the producer is there
    error: str | None = None
    abandoned: bool = False  # its request ended (aborted) while the thread ran
    turn: threading.Event = field(default_factory=threading.Event)  # set: it may meet its producer now


class _PullReply(BaseModel):
    model_config = ConfigDict(extra="ignore")  # JSON: the store's [host, port] becomes a tuple
    group_name: str
    store: tuple[StrictStr, StrictInt]
    layout: dict
    blocks: list[StrictInt]
    ticket: StrictStr


def instance_layout(engine: LLMEngine) -> InstanceLayout:
    config = engine.config
    p = config.parallel
    return InstanceLayout(config.dcp_layout, kv_heads_of_ranks(config.model.num_kv_heads, p.tensor_parallel_size, p.decode_context_parallel_size))


def model_signature(engine: LLMEngine) -> dict[str, Any]:
    """What both sides must share for KV to mean the same thing."""
    spec, model = engine.config.kv_cache_spec, engine.config.model
    return {"layers": spec.num_layers, "kv_heads": model.num_kv_heads, "key_dim": spec.key_dim,
            "value_dim": spec.value_dim, "dtype": str(model.dtype), "vocab": model.hf_config.vocab_size,
            "kv_cache_dtype": str(engine.config.kv_cache_dtype)}  # the bytes moved are the cache's


def _layout_json(layout: InstanceLayout) -> dict:
    d = layout.layout
    return {"block_size": d.block_size, "dcp": d.dcp_size, "interleave": d.interleave,
            "rank_heads": [[h.start, h.stop] for h in layout.rank_heads]}


def _layout_from_json(raw: dict) -> InstanceLayout:
    """Raises ValueError (or KeyError, TypeError) for anything that is not a layout."""
    values = [raw["block_size"], raw["dcp"], raw["interleave"]]
    heads = raw["rank_heads"]
    if (not all(type(v) is int and 1 <= v <= 2**16 for v in values) or not isinstance(heads, list)
            or not 1 <= len(heads) <= 4096
            or not all(isinstance(h, list) and len(h) == 2 and all(type(x) is int and 0 <= x <= 2**16 for x in h)
                       and h[0] < h[1] for h in heads)):
        raise ValueError(f"not a layout: {raw!r:.200}")
    return InstanceLayout(DCPLayout(*values), tuple(range(a, b) for a, b in heads))


class KVConnector:
    """Attached to an `LLMEngine` as `engine.kv_connector`; the engine calls `before_schedule`,
    `on_finish`, `forget` and `has_pending` from its step (engine thread, under its lock), and
    `close` when it shuts down. `secret` is the deployment's (disagg/secret.py); `api_key` the key
    this instance's peers ask for, if any."""

    def __init__(self, engine: LLMEngine, config: KVTransferConfig, secret: str, api_key: str | None = None,
                 clock: Callable[[], float] = time.monotonic, start_store: bool = True) -> None:
        self.engine = engine
        self.config = config
        self.secret = secret
        self.api_key = api_key
        self.clock = clock
        self.layout = instance_layout(engine)
        self.signature = model_signature(engine)
        self.groups = PairGroups()
        self.wake: Callable[[], None] = lambda: None  # set by the server: makes its engine loop look for work
        self._lock = threading.Lock()  # what HTTP handlers and threads hand to the engine thread
        # producer
        self._holds: dict[str, _Hold] = {}
        self._ready: deque[tuple[KVTransferPlan, str]] = deque()  # sends whose consumer is there
        self._dropped: deque[tuple[str, str]] = deque()  # (transfer id, reason) of claimed holds to free
        self._releases: deque[str] = deque()  # transfer ids the proxy released
        self._released: dict[str, float] = {}  # released before their hold was made: until when to remember
        self._nonces: dict[tuple[str, int], str] = {}  # per (consumer, generation): its group's unguessable name
        self.holds_total = 0
        self.freed: Counter[str] = Counter({reason: 0 for reason in FREE_REASONS})
        # consumer
        self.producers: dict[str, str] = dict(config.producers)  # engine id -> URL: whom this one may pull from
        self._owned: dict[int, _Fetch] = {}  # by seq_id: requests in no scheduler queue while their KV comes
        self._queue: deque[_Fetch] = deque()  # not started yet, in arrival order
        # per producer, fetches in the order they started: each meets its producer (and so transfers) only
        # once the one before it is over, so that both sides run a pair's transfers in the same order
        self._order: dict[str, deque[_Fetch]] = {}
        self._done: deque[_Fetch] = deque()  # fetches whose thread finished
        self._generation: dict[str, int] = {}  # per producer, bumped after a failed transfer
        self.fetches: Counter[str] = Counter({"ok": 0, "failed": 0})
        self.store = None
        if config.is_producer and start_store:
            # the rendezvous of every pair group this producer joins; consumer ranks connect as clients
            self.store = bound_store(config.kv_ip, config.kv_port)
        engine.kv_connector = self

    @property
    def store_address(self) -> tuple[str, int]:
        return self.config.kv_ip, self.store.port

    def info(self) -> dict:
        """This instance as another one sees it: role, id, layout and the model's KV signature."""
        return {"kv_role": self.config.kv_role, "engine_id": self.config.engine_id,
                "layout": _layout_json(self.layout), "signature": self.signature}

    @property
    def num_held_blocks(self) -> int:
        with self._lock:
            return sum(len(h.blocks) for h in self._holds.values())

    @property
    def num_holds(self) -> int:
        return len(self._holds)

    def register(self, engine_id: str, url: str) -> None:
        """Consumer: the proxy says where producer `engine_id` answers pulls."""
        with self._lock:
            self.producers[engine_id] = url.rstrip("/")

    # --- engine hooks (engine thread) ----------------------------------------------------
    def has_pending(self) -> bool:
        """Work for the engine thread even when no request runs."""
        now = self.clock()
        with self._lock:
            if self._ready or self._dropped or self._releases or self._done:
                return True
            if any(not h.claimed and h.deadline <= now for h in self._holds.values()):
                return True
        return any(self._startable(f) for f in self._queue)

    def on_finish(self, seq: Sequence) -> None:
        """Producer: called as a sequence finishes normally, before its blocks are released."""
        params = seq.params.kv_transfer_params or {}
        if not (self.config.is_producer and params.get("do_remote_decode")):
            return
        transfer_id = str(params.get("transfer_id") or seq.request_id)
        with self._lock:
            if transfer_id in self._holds:
                logger.warning("transfer id %s is already held; its KV is not kept twice", transfer_id)
                return
            self.holds_total += 1
            if self._released.pop(transfer_id, None) is not None:
                self.freed["released"] += 1  # the proxy gave up on it before it finished
                return
            self.engine.pool.take(seq.block_table)  # the finish drops the request's reference, this one stays
            self._holds[transfer_id] = _Hold(list(seq.block_table), seq.num_computed_tokens,
                                             self.clock() + self.config.hold_timeout_s)

    def forget(self, seq: Sequence) -> None:
        """A request ends (aborted, failed) while the connector holds it: back to the scheduler's queue,
        so that `Scheduler.finish` ends it as any waiting request; blocks still receiving are freed once
        the transfer is over."""
        fetch = self._owned.pop(seq.seq_id, None)
        if fetch is None:
            return
        if fetch in self._queue:
            self._queue.remove(fetch)
        else:
            fetch.abandoned = True
        self.engine.scheduler.waiting.append(seq)

    def before_schedule(self) -> list[RequestOutput]:
        """Run what waits for the engine thread; outputs of consumer requests whose fetch failed.
        Nothing one transfer does raises out of here, but a dead engine (EngineDeadError)."""
        self._free_what_ended()
        while True:
            with self._lock:
                if not self._ready:
                    break
                plan, transfer_id = self._ready.popleft()
            ok = self._transfer(plan)
            self._free_hold(transfer_id, "fetched" if ok else "failed")
        if self.config.is_producer:
            return []
        failed: list[RequestOutput] = []
        while True:
            with self._lock:
                if not self._done:
                    break
                fetch = self._done.popleft()
            try:
                output = self._finish_fetch(fetch)
            except EngineDeadError:
                raise
            except Exception as error:  # a bug in one fetch ends that request, not the engine
                logger.exception("finishing the fetch of %s failed", fetch.seq.request_id)
                output = next(iter(self._fail(fetch, f"{error!r}")), None)
            if output is not None:
                failed.append(output)
        self._take_new_requests()
        for fetch in [f for f in self._queue if self._startable(f)]:
            if self._startable(fetch):  # an earlier start this round may have taken the producer or blocks
                try:
                    failed.extend(self._start_fetch(fetch))
                except Exception as error:
                    logger.exception("starting the fetch of %s failed", fetch.seq.request_id)
                    self._next_turn(fetch)
                    failed.extend(self._fail(fetch, f"{error!r}"))
        return failed

    def close(self) -> None:
        """The engine shuts down: every hold and every reserved block goes back."""
        with self._lock:
            holds, self._holds = self._holds, {}
        for hold in holds.values():
            self.engine.pool.free(hold.blocks)
            self.freed["shutdown"] += 1
        for fetch in list(self._owned.values()):
            if fetch.blocks:
                self.engine.pool.free(fetch.blocks)
                fetch.blocks = []

    # --- producer -----------------------------------------------------------------------
    def _free_hold(self, transfer_id: str, reason: str) -> None:
        with self._lock:
            hold = self._holds.pop(transfer_id, None)
        if hold is None:
            return
        if reason not in ("fetched", "released"):
            logger.warning("the KV of %s is freed: %s", transfer_id, reason)
        self.engine.pool.free(hold.blocks)
        self.freed[reason] += 1

    def _free_what_ended(self) -> None:
        now = self.clock()
        with self._lock:
            expired = [t for t, h in self._holds.items() if not h.claimed and h.deadline <= now]
            dropped, self._dropped = list(self._dropped), deque()
            releases, self._releases = list(self._releases), deque()
            for t, until in list(self._released.items()):
                if until <= now:
                    del self._released[t]
        for transfer_id in expired:
            self._free_hold(transfer_id, "timeout")
        for transfer_id, _reason in dropped:
            self._free_hold(transfer_id, "failed")
        for transfer_id in releases:
            with self._lock:
                hold = self._holds.get(transfer_id)
                if hold is None:
                    self._released[transfer_id] = now + self.config.hold_timeout_s
                    continue
                if hold.claimed:
                    continue  # its consumer is fetching it after all: the send frees it
            self._free_hold(transfer_id, "released")

    def release(self, transfer_id: str) -> None:
        """Producer, any thread: the proxy no longer wants this KV (the consumer refused the request or its
        client left). Freed between two steps unless a consumer is already fetching it."""
        with self._lock:
            self._releases.append(transfer_id)
        self.wake()

    def serve_pull(self, body: Any) -> dict:
        """Producer, HTTP handler: a consumer asks for a held request's KV. Everything is checked before
        the hold is claimed; answers with what the consumer needs to run the same plan, and starts the
        thread that waits for the consumer in the store."""
        if not self.config.is_producer:
            raise PullRefused(400, "this instance is not a kv_producer")
        try:
            pull = PullRequest.model_validate(body)
        except ValidationError as error:
            raise PullRefused(400, f"malformed pull request: {first_error(error, 'body')[0]}") from None
        if pull.signature != self.signature:
            raise PullRefused(400, f"the consumer's model {pull.signature} differs from the producer's {self.signature}")
        try:
            consumer_layout = _layout_from_json(pull.layout)
        except (KeyError, TypeError, ValueError) as error:
            raise PullRefused(400, f"malformed pull request: layout: {error}") from None
        with self._lock:
            hold = self._holds.get(pull.transfer_id)
            if hold is None or hold.claimed:
                raise PullRefused(404, f"no KV is held for transfer {pull.transfer_id!r} (never prefilled here, "
                                       "already fetched, released or expired)")
            if not pull.num_tokens <= hold.num_tokens:
                raise PullRefused(400, f"asked for {pull.num_tokens} tokens, {hold.num_tokens} are held")
            nonce = self._nonces.setdefault((pull.consumer_id, pull.generation), secrets.token_hex(16))
            group_name = f"{self.config.engine_id}/{pull.consumer_id}/{pull.generation}/{nonce}"
            plan = KVTransferPlan(group_name, self.store_address, True, self.layout, hold.blocks, consumer_layout,
                                  list(pull.blocks), pull.num_tokens, self.config.transfer_timeout_s,
                                  self.config.kv_ip)
            try:
                plan.transfers()  # the consumer's layout and blocks fit the tokens: checked here, not mid-send
            except Exception as error:
                raise PullRefused(400, f"malformed pull request: the consumer's layout and blocks do not "
                                       f"hold {pull.num_tokens} tokens: {error}") from None
            hold.claimed = True
            ticket = secrets.token_hex(16)
        self._spawn(self._meet_consumer, plan, pull.transfer_id, ticket)
        return {"group_name": group_name, "store": list(self.store_address), "layout": _layout_json(self.layout),
                "blocks": hold.blocks, "ticket": ticket}

    def _meet_consumer(self, plan: KVTransferPlan, transfer_id: str, ticket: str) -> None:
        """Thread: wait for the consumer in the store; then the engine thread sends."""
        try:
            # as long as an unclaimed hold waits: the consumer may have transfers from here queued before it
            self._meet(plan.store, ticket, "producer", "consumer", max(self.config.hold_timeout_s, plan.timeout_s))
        except Exception as error:
            logger.warning("the consumer of %s never came to the transfer: %s", transfer_id, error)
            with self._lock:
                self._dropped.append((transfer_id, "failed"))
        else:
            with self._lock:
                self._ready.append((plan, transfer_id))
        self.wake()

    # --- consumer -----------------------------------------------------------------------
    def _take_new_requests(self) -> None:
        """Requests that fetch their prompt's KV leave the scheduler's queue for the connector's."""
        scheduler = self.engine.scheduler
        for seq in [s for s in scheduler.waiting if (s.params.kv_transfer_params or {}).get("do_remote_prefill")]:
            params = seq.params.kv_transfer_params
            seq.params.kv_transfer_params = None  # fetched once: after a preemption the prompt is recomputed
            scheduler.waiting.remove(seq)
            fetch = _Fetch(seq, str(params.get("remote_engine_id")), str(params.get("transfer_id")))
            self._owned[seq.seq_id] = fetch
            self._queue.append(fetch)

    def _startable(self, fetch: _Fetch) -> bool:
        engine = self.engine
        in_flight = sum(1 for f in self._owned.values() if f.blocks)
        if len(engine.scheduler.running) + in_flight >= engine.config.scheduler.max_num_seqs:
            return False
        return engine.layout.num_virtual_blocks(fetch.seq.num_tokens) <= engine.pool.num_free

    def _start_fetch(self, fetch: _Fetch) -> list[RequestOutput]:
        self._queue.remove(fetch)
        with self._lock:
            url = self.producers.get(fetch.producer_id)
        if url is None:  # the door checks this; a registration cannot be taken back, but be sure
            return self._fail(fetch, f"producer {fetch.producer_id!r} is not one this consumer may pull from")
        fetch.blocks = self.engine.pool.allocate(self.engine.layout.num_virtual_blocks(fetch.seq.num_tokens))
        order = self._order.setdefault(fetch.producer_id, deque())
        order.append(fetch)
        if order[0] is fetch:
            fetch.turn.set()
        generation = self._generation.setdefault(fetch.producer_id, 0)
        self._spawn(self._pull, fetch, url, generation)
        return []

    def _pull(self, fetch: _Fetch, url: str, generation: int) -> None:
        """Thread: ask the producer, then meet it in its store; the engine thread receives."""
        num_tokens = fetch.seq.num_tokens - 1
        try:
            headers = {HEADER: self.secret}
            if self.api_key:
                headers["authorization"] = f"Bearer {self.api_key}"
            try:
                answer = httpx.post(f"{url}/kv_transfer/pull", timeout=self.config.transfer_timeout_s,
                                    headers=headers, json={
                                        "transfer_id": fetch.transfer_id, "consumer_id": self.config.engine_id,
                                        "generation": generation, "num_tokens": num_tokens,
                                        "layout": _layout_json(self.layout), "blocks": fetch.blocks,
                                        "signature": self.signature})
            except httpx.HTTPError as error:
                raise _FetchFailed(f"the producer at {url} cannot be reached: {error!r}") from None
            if answer.status_code != 200:
                try:
                    why = answer.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    why = f"status {answer.status_code}: {answer.text[:200]}"
                raise _FetchFailed(f"the producer at {url} refused: {why}")
            try:
                reply = _PullReply.model_validate(answer.json())
                plan = KVTransferPlan(reply.group_name, reply.store, False, _layout_from_json(reply.layout),
                                      reply.blocks, self.layout, fetch.blocks, num_tokens,
                                      self.config.transfer_timeout_s, self.config.kv_ip)
                plan.transfers()
            except Exception as error:
                raise _FetchFailed(f"the producer at {url} answered what is not a transfer: {error}") from None
            wait_s = max(self.config.hold_timeout_s, plan.timeout_s)
            if not fetch.turn.wait(wait_s):  # the fetches before it are still transferring
                raise _FetchFailed(f"the transfers from {url} before this one took over {wait_s:g} s")
            try:
                self._meet(plan.store, reply.ticket, "consumer", "producer", plan.timeout_s)
            except Exception as error:
                raise _FetchFailed(f"the producer at {url} never came to the transfer: {error}") from None
            fetch.plan = plan
        except _FetchFailed as error:
            fetch.error = str(error)
        except Exception as error:  # whatever it is, it ends this request only
            fetch.error = f"fetching from {url} failed: {error!r}"
        with self._lock:
            self._done.append(fetch)
        self.wake()

    def _finish_fetch(self, fetch: _Fetch) -> RequestOutput | None:
        """Engine thread: a fetch's thread is done; receive, then run the request (or fail it)."""
        ok = fetch.error is None
        try:
            if ok:
                ok = self._transfer(fetch.plan)
                if not ok:
                    self._generation[fetch.producer_id] = self._generation.get(fetch.producer_id, 0) + 1
                    fetch.error = "receiving the KV from the producer failed (it died or timed out)"
        finally:
            self._next_turn(fetch)
        self.fetches["ok" if ok else "failed"] += 1
        if fetch.abandoned:
            self.engine.pool.free(fetch.blocks)
            return None
        if not ok:
            return self._fail(fetch, fetch.error)[0]
        seq = fetch.seq
        del self._owned[seq.seq_id]
        seq.block_table, seq.num_computed_tokens = fetch.blocks, fetch.plan.num_tokens
        seq.status = SequenceStatus.RUNNING
        self.engine.scheduler.running.append(seq)
        return None

    def _next_turn(self, fetch: _Fetch) -> None:
        """`fetch` is over: the next fetch from its producer may meet it."""
        order = self._order.get(fetch.producer_id)
        if order is None or fetch not in order:
            return
        order.remove(fetch)
        if order:
            order[0].turn.set()
        else:
            del self._order[fetch.producer_id]

    def _fail(self, fetch: _Fetch, reason: str) -> list[RequestOutput]:
        logger.warning("request %s: %s", fetch.seq.request_id, reason)
        if fetch.blocks:
            self.engine.pool.free(fetch.blocks)
            fetch.blocks = []
        seq, scheduler = fetch.seq, self.engine.scheduler
        self._owned.pop(seq.seq_id, None)
        if fetch in self._queue:
            self._queue.remove(fetch)
        if seq.status is SequenceStatus.WAITING and seq not in scheduler.waiting:
            scheduler.waiting.append(seq)  # back in the scheduler's queue, so that it ends as any request
        request = self.engine.requests.pop(seq.request_id, None)
        if request is None:
            if not seq.is_finished:
                scheduler.finish(seq, "abort")
            return []
        request.error = f"fetching the prompt's KV failed: {reason}"
        self.engine._finish_all(request, "error")
        return [self.engine.output_processor.output(request)]

    # --- both ---------------------------------------------------------------------------
    def _spawn(self, target: Callable, *args) -> None:
        threading.Thread(target=target, args=args, name="kvshard-kv-transfer", daemon=True).start()

    def _meet(self, store: tuple[str, int], ticket: str, me: str, peer: str, timeout_s: float) -> None:
        """Say in the producer's store that this side is ready for the transfer under `ticket`, and wait
        (at most `timeout_s`) until the peer says so too. Off the engine thread."""
        timeout = datetime.timedelta(seconds=timeout_s)
        client = dist.TCPStore(store[0], store[1], is_master=False, timeout=timeout, wait_for_workers=False)
        client.set(f"kvshard-ready/{ticket}/{me}", "1")
        client.wait([f"kvshard-ready/{ticket}/{peer}"], timeout)

    def _transfer(self, plan: KVTransferPlan) -> bool:
        """Engine thread: both sides are there; every rank moves its share. False if it failed."""
        try:
            return self._on_every_rank(plan)
        except EngineDeadError:
            raise
        except Exception as error:  # a transfer's failure is that transfer's
            logger.warning("KV transfer %s failed: %r", plan.group_name, error)
            return False

    def _on_every_rank(self, plan: KVTransferPlan) -> bool:
        executor = self.engine.executor
        executor.check_alive()
        broadcast_from_driver(plan, executor.parallel)
        return transfer_on_rank(plan, executor.parallel, executor.runner.kv_caches, self.groups, executor.device)


class _FetchFailed(Exception):
    pass
