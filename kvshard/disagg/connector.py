"""Disaggregated prefill/decode behind the scheduler's KV-connector hooks (engine/kv_connector.py).

Producer: a request that asks for it (`kv_transfer_params.do_remote_decode`) keeps
its KV blocks when it finishes (`request_finished` says True: the scheduler keeps
them), under the transfer id the proxy gave, until a consumer fetches them, the
proxy releases them (the consumer refused the request, or its client left),
`hold_timeout_s` passes, or the producer shuts down; then `get_finished` lists it
and the scheduler frees the blocks. A consumer's pull arrives over HTTP
(`serve_pull`), is checked whole before the hold is claimed, and is answered at
once with the producer's layout, blocks and a ticket; a thread then waits (at
most `transfer_timeout_s`) until the consumer says, in the producer's store under
that ticket, that it is there (as long as an unclaimed hold would wait), and only
then is the send started, between two steps.

Consumer: a request with `kv_transfer_params.do_remote_prefill` loads all its
prompt's KV but the last token's (`get_num_external_tokens`); once the scheduler
has reserved its blocks (`start_load`) a thread asks its producer (known by engine
id: configured in `kv_connector_extra_config.producers`, or registered by the
proxy) and meets it in the store; the receive is then started between two steps,
and once every rank has its share the scheduler learns it from `get_finished`: the
request joins the running batch with all prompt tokens but the last computed, so
its first step computes that token and samples the first output token as a
colocated engine would. Pulls run side by side (each claims its hold at once),
but a fetch meets its producer only once the fetch from that producer before it
is over, so both sides run a pair's transfers in the same order. If anything
fails, that request alone ends with an error and the scheduler frees its blocks.
A preempted request recomputes its prompt: the producer no longer holds the KV.

A transfer itself (transfer.py) runs on threads too: between two steps the engine
thread only broadcasts a `TransferTask` to its ranks, each of which runs its share
on a thread of its own and says in rank 0's store how it went; a thread of rank 0
runs rank 0's share and waits for the others'. HTTP, DNS, store waits and the
transfers never run on the engine thread nor under the engine's lock: a slow or
dead peer delays its own requests only.
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
from kvshard.disagg.params import PullRequest, first_error, prompt_digest
from kvshard.disagg.secret import HEADER
from kvshard.disagg.transfer import KVTransferPlan, PairGroups, TransferTask, bound_store, run_transfer
from kvshard.engine import rank_messages
from kvshard.engine.executor import EngineDeadError
from kvshard.engine.kv_connector import KVConnectorBase
from kvshard.kv.layout import DCPLayout
from kvshard.kv.relayout import InstanceLayout, kv_heads_of_ranks

if TYPE_CHECKING:
    from kvshard.engine.llm_engine import LLMEngine
    from kvshard.engine.sequence import Sequence

logger = logging.getLogger("kvshard.disagg")

FREE_REASONS = ("fetched", "failed", "timeout", "released", "shutdown")
FETCH_RESULTS = ("ok", "failed", "abandoned")  # a consumer's fetches end so (abandoned: its request ended first)


def _post_within(url: str, timeout: float, **kwargs) -> httpx.Response:
    """`httpx.post` bounded as a whole: httpx's timeout bounds each read, so a peer that answers a byte at a time
    would hold a pull (and the blocks reserved for it) for as long as it likes. The call runs in a thread of its
    own; past `timeout` the pull fails (httpx.TimeoutException) and the thread is left to end with its connection."""
    done: dict[str, Any] = {}

    def call() -> None:
        try:
            done["answer"] = httpx.post(url, timeout=timeout, **kwargs)
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            done["error"] = error

    worker = threading.Thread(target=call, name="kv-pull-request", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise httpx.TimeoutException(f"no whole answer within {timeout:g} s")
    if "error" in done:
        raise done["error"]
    return done["answer"]


# what a producer's refusal says when the two sides' prompts differ
SAME_PROMPT = ("the producer and the consumer must render and tokenize a request alike: the same model files, "
               "tokenizer and --chat-template on both")


class PullRefused(Exception):
    """A consumer asked for KV this producer cannot send (unknown, expired, other model, malformed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Hold:
    seq_id: int  # the finished request's, whose blocks the scheduler keeps
    blocks: list[int]
    num_tokens: int  # tokens whose KV the blocks hold
    token_ids: list[int]  # the request's prompt, whose first num_tokens tokens those are
    deadline: float
    claimed: bool = False  # a consumer is fetching it: the send (or its failure) frees it, not the timeout


@dataclass
class _Fetch:
    """Consumer: one request's KV on its way here."""

    seq_id: int
    request_id: str
    producer_id: str
    transfer_id: str
    blocks: list[int]  # the scheduler's, reserved for the whole prompt
    num_tokens: int  # whose KV comes
    token_ids: list[int]  # the request's prompt, whose first num_tokens tokens' KV comes
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


class KVConnector(KVConnectorBase):
    """The `KVShardConnector` (engine/kv_connector.py's hooks); attached with `LLMEngine.attach_kv_connector`.
    `secret` is the deployment's (disagg/secret.py); `api_key` the key this instance's peers ask for, if any.
    Reads the engine's configuration, and its executor's ranks and KV caches for the transfers; the
    scheduler's queues, the block pool and the requests are the scheduler's and the engine's alone."""

    def __init__(self, engine: LLMEngine, config: KVTransferConfig, secret: str, api_key: str | None = None,
                 clock: Callable[[], float] = time.monotonic, start_store: bool = True) -> None:
        self.engine = engine
        self.config = config
        self.secret = secret
        self.api_key = api_key
        self.clock = clock
        self.layout = instance_layout(engine)
        self.signature = model_signature(engine)
        self.world_size = engine.config.parallel.tensor_parallel_size
        self.groups = PairGroups()
        self.wake: Callable[[], None] = lambda: None  # set by the server: makes its engine loop look for work
        self._lock = threading.Lock()  # what HTTP handlers and threads hand to the engine thread
        # producer
        self._holds: dict[str, _Hold] = {}
        self._ready: deque[tuple[KVTransferPlan, str]] = deque()  # sends whose consumer is there
        self._sent: deque[tuple[str, bool]] = deque()  # (transfer id, ok) of sends over
        self._dropped: deque[tuple[str, str]] = deque()  # (transfer id, reason) of claimed holds to free
        self._releases: deque[str] = deque()  # transfer ids the proxy released
        self._released: dict[str, float] = {}  # released before their hold was made: until when to remember
        self._nonces: dict[tuple[str, int], str] = {}  # per (consumer, generation): its group's unguessable name
        self._saved: list[int] = []  # engine thread: seq_ids whose hold ended, for get_finished
        self.holds_total = 0
        self.freed: Counter[str] = Counter({reason: 0 for reason in FREE_REASONS})
        # consumer
        self.producers: dict[str, str] = dict(config.producers)  # engine id -> URL: whom this one may pull from
        self._fetches: dict[int, _Fetch] = {}  # by seq_id: loads started, not answered yet
        # per producer, fetches in the order they started: each meets its producer (and so transfers) only
        # once the one before it is over, so that both sides run a pair's transfers in the same order
        self._order: dict[str, deque[_Fetch]] = {}
        self._met: deque[_Fetch] = deque()  # fetches whose thread finished: the producer is there, or an error
        self._received: deque[tuple[_Fetch, bool]] = deque()  # (fetch, ok) of receives over
        self._loaded: dict[int, str | None] = {}  # engine thread: loads over, for get_finished
        self._generation: dict[str, int] = {}  # per producer, bumped after a failed transfer
        self.fetches: Counter[str] = Counter({result: 0 for result in FETCH_RESULTS})
        self.store = None  # the producer's rendezvous of every pair group it joins
        self.rank_store = None  # where this instance's ranks > 0 say how their share of a transfer went
        if start_store and (config.is_producer or self.world_size > 1):
            self.store = self.rank_store = bound_store(config.kv_ip, config.kv_port if config.is_producer else 0)

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

    # --- the scheduler's hooks (engine thread, under the engine's lock; none waits) --------------
    def get_num_external_tokens(self, seq: Sequence) -> int:
        """Consumer: a request with `do_remote_prefill` loads all its prompt's KV but the last token's."""
        params = seq.params.kv_transfer_params or {}
        if self.config.is_producer or not params.get("do_remote_prefill"):
            return 0
        return seq.num_tokens - 1

    def start_load(self, seq: Sequence, blocks: list[int], num_tokens: int) -> None:
        params = seq.params.kv_transfer_params or {}
        fetch = _Fetch(seq.seq_id, seq.request_id, str(params.get("remote_engine_id")),
                       str(params.get("transfer_id")), list(blocks), num_tokens, seq.prompt_token_ids)
        self._fetches[seq.seq_id] = fetch
        with self._lock:
            url = self.producers.get(fetch.producer_id)
        if url is None:  # the door checks this; a registration cannot be taken back, but be sure
            self._answer(fetch, f"producer {fetch.producer_id!r} is not one this consumer may pull from")
            return
        with self._lock:
            order = self._order.setdefault(fetch.producer_id, deque())
            order.append(fetch)
            if order[0] is fetch:
                fetch.turn.set()
        generation = self._generation.setdefault(fetch.producer_id, 0)
        try:
            self._spawn(self._pull, fetch, url, generation)
        except Exception as error:  # e.g. no thread to be had: this request fails, not the engine
            self._next_turn(fetch)
            self._answer(fetch, f"the fetch could not start: {error!r}")

    def abort_load(self, seq: Sequence) -> None:
        """Its transfer still runs to its end (both sides keep a pair's order); then the blocks go back."""
        fetch = self._fetches.get(seq.seq_id)
        if fetch is not None:
            fetch.abandoned = True

    def request_finished(self, seq: Sequence) -> bool:
        """Producer: a request with `do_remote_decode` keeps its blocks under its transfer id until a consumer
        fetches them, the proxy releases them, or `hold_timeout_s` passes."""
        params = seq.params.kv_transfer_params or {}
        if not (self.config.is_producer and params.get("do_remote_decode")):
            return False
        if seq.num_computed_tokens <= 1:
            # the prompt's tokens (max_tokens is 1: the sampled one is not computed). A consumer loads every prompt
            # token's KV but the last (get_num_external_tokens): none of a one-token prompt, so it never pulls, and
            # a hold would only keep blocks from others until its timeout
            return False
        transfer_id = str(params.get("transfer_id") or seq.request_id)
        with self._lock:
            if transfer_id in self._holds:
                logger.warning("transfer id %s is already held; its KV is not kept twice", transfer_id)
                return False
            self.holds_total += 1
            if self._released.pop(transfer_id, None) is not None:
                self.freed["released"] += 1  # the proxy gave up on it before it finished
                return False
            self._holds[transfer_id] = _Hold(seq.seq_id, list(seq.block_table), seq.num_computed_tokens,
                                             seq.prompt_token_ids, self.clock() + self.config.hold_timeout_s)
        return True

    def get_finished(self) -> tuple[dict[int, str | None], list[int]]:
        loaded, self._loaded = self._loaded, {}
        saved, self._saved = self._saved, []
        return loaded, saved

    def has_pending(self) -> bool:
        """Work for the engine thread even when no request runs."""
        if self._loaded or self._saved:
            return True
        now = self.clock()
        with self._lock:
            if self._ready or self._sent or self._dropped or self._releases or self._met or self._received:
                return True
            return any(not h.claimed and h.deadline <= now for h in self._holds.values())

    def between_steps(self) -> None:
        """Free the holds that ended, start the transfers whose peer is there, answer the loads that are over.
        Nothing one transfer does raises out of here, but a dead engine (EngineDeadError)."""
        self._free_what_ended()
        for plan, transfer_id in self._take(self._ready):
            self._start_transfer(plan, lambda ok, t=transfer_id: self._post(self._sent, (t, ok)))
        for transfer_id, ok in self._take(self._sent):
            self._free_hold(transfer_id, "fetched" if ok else "failed")
        for fetch in self._take(self._met):
            try:
                if fetch.error is not None:
                    self._next_turn(fetch)
                    self._answer(fetch, fetch.error)
                else:
                    self._start_transfer(fetch.plan, lambda ok, f=fetch: self._receive_over(f, ok))
            except EngineDeadError:
                raise
            except Exception as error:  # a bug in one fetch ends that request, not the engine
                logger.exception("finishing the fetch of %s failed", fetch.request_id)
                self._next_turn(fetch)
                self._answer(fetch, f"{error!r}")
        for fetch, ok in self._take(self._received):
            self._received_one(fetch, ok)

    def close(self) -> None:
        """The engine shuts down: every hold and every reserved block is answered for, to go back."""
        with self._lock:
            holds, self._holds = self._holds, {}
        for hold in holds.values():
            self._saved.append(hold.seq_id)
            self.freed["shutdown"] += 1
        for fetch in list(self._fetches.values()):
            self._answer(fetch, "the server is shutting down")

    # --- producer -----------------------------------------------------------------------
    def _free_hold(self, transfer_id: str, reason: str) -> None:
        with self._lock:
            hold = self._holds.pop(transfer_id, None)
        if hold is None:
            return
        if reason not in ("fetched", "released"):
            logger.warning("the KV of %s is freed: %s", transfer_id, reason)
        self._saved.append(hold.seq_id)
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
        # the prompt's digest, O(its tokens), outside the lock that the engine thread takes between two steps; the
        # hold is looked up again under it (a dict lookup is atomic), and must be the one hashed here
        held = self._holds.get(pull.transfer_id)
        if (held is not None and pull.num_tokens <= held.num_tokens
                and prompt_digest(held.token_ids[:pull.num_tokens]) != pull.prompt_digest):
            raise PullRefused(409, f"the consumer's first {pull.num_tokens} prompt tokens are not those "
                                   f"prefilled here ({SAME_PROMPT})")
        with self._lock:
            hold = self._holds.get(pull.transfer_id)
            if hold is None or hold.claimed or hold is not held:
                raise PullRefused(404, f"no KV is held for transfer {pull.transfer_id!r} (never prefilled here, "
                                       "already fetched, released or expired)")
            if not pull.num_tokens <= hold.num_tokens:
                raise PullRefused(409, f"asked for {pull.num_tokens} tokens, {hold.num_tokens} are held: the "
                                       f"consumer's prompt is longer than the one prefilled here ({SAME_PROMPT})")
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
    def _pull(self, fetch: _Fetch, url: str, generation: int) -> None:
        """Thread: ask the producer, then meet it in its store; then the engine thread has the ranks receive."""
        num_tokens = fetch.num_tokens
        try:
            headers = {HEADER: self.secret}
            if self.api_key:
                headers["authorization"] = f"Bearer {self.api_key}"
            try:
                answer = _post_within(f"{url}/kv_transfer/pull", self.config.transfer_timeout_s,
                                      headers=headers, json={
                                          "transfer_id": fetch.transfer_id, "consumer_id": self.config.engine_id,
                                          "generation": generation, "num_tokens": num_tokens,
                                          "layout": _layout_json(self.layout), "blocks": fetch.blocks,
                                          "signature": self.signature,
                                          "prompt_digest": prompt_digest(fetch.token_ids[:num_tokens])})
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
        if fetch.error is not None:
            self._next_turn(fetch)
        self._post(self._met, fetch)

    def _receive_over(self, fetch: _Fetch, ok: bool) -> None:
        """Thread: every rank's receive is over; the fetch from this producer after it may meet it now."""
        self._next_turn(fetch)
        self._post(self._received, (fetch, ok))

    def _received_one(self, fetch: _Fetch, ok: bool) -> None:
        """Engine thread: the load is answered."""
        if not ok:
            self._generation[fetch.producer_id] = self._generation.get(fetch.producer_id, 0) + 1
        self._answer(fetch, None if ok else "receiving the KV from the producer failed (it died or timed out)")

    def _answer(self, fetch: _Fetch, error: str | None) -> None:
        """Engine thread: the load is over; the scheduler learns it from get_finished."""
        if self._fetches.pop(fetch.seq_id, None) is None:
            return  # answered already (at shutdown)
        # a fetch whose request ended while it ran (the client left) and that did not finish is not a failure
        self.fetches["ok" if error is None else "abandoned" if fetch.abandoned else "failed"] += 1
        if error is not None and not fetch.abandoned:
            logger.warning("request %s: %s", fetch.request_id, error)
        self._loaded[fetch.seq_id] = error

    def _next_turn(self, fetch: _Fetch) -> None:
        """Any thread: `fetch` is over: the next fetch from its producer may meet it."""
        with self._lock:
            order = self._order.get(fetch.producer_id)
            if order is None or fetch not in order:
                return
            order.remove(fetch)
            if order:
                order[0].turn.set()
            else:
                del self._order[fetch.producer_id]

    # --- both ---------------------------------------------------------------------------
    def _spawn(self, target: Callable, *args) -> None:
        threading.Thread(target=target, args=args, name="kvshard-kv-transfer", daemon=True).start()

    def _take(self, queue: deque) -> list:
        with self._lock:
            items = list(queue)
            queue.clear()
        return items

    def _post(self, queue: deque, item) -> None:
        """Any thread: hand `item` to the engine thread and wake it."""
        with self._lock:
            queue.append(item)
        self.wake()

    def _meet(self, store: tuple[str, int], ticket: str, me: str, peer: str, timeout_s: float) -> None:
        """Say in the producer's store that this side is ready for the transfer under `ticket`, and wait
        (at most `timeout_s`) until the peer says so too. Off the engine thread."""
        timeout = datetime.timedelta(seconds=timeout_s)
        client = dist.TCPStore(store[0], store[1], is_master=False, timeout=timeout, wait_for_workers=False)
        client.set(f"kvshard-ready/{ticket}/{me}", "1")
        client.wait([f"kvshard-ready/{ticket}/{peer}"], timeout)

    def _start_transfer(self, plan: KVTransferPlan, done: Callable[[bool], None]) -> None:
        """Engine thread, between two steps: the other ranks start their share (on threads of theirs), and a
        thread runs rank 0's and waits for theirs; `done(ok)` once every rank's share is over. Waits for
        no peer."""
        try:
            task = self._to_ranks(plan)
        except EngineDeadError:
            raise
        except Exception as error:
            logger.warning("KV transfer %s could not start: %r", plan.group_name, error)
            done(False)
            return
        self._spawn(self._transfer, task, done)

    def _to_ranks(self, plan: KVTransferPlan) -> TransferTask:
        task = TransferTask(plan, secrets.token_hex(8), self.rank_address)
        if self.world_size > 1:
            executor = self.engine.executor
            executor.check_alive()
            rank_messages.send(task, executor.parallel)
        return task

    @property
    def rank_address(self) -> tuple[str, int] | None:
        return (self.config.kv_ip, self.rank_store.port) if self.rank_store is not None else None

    def _transfer(self, task: TransferTask, done: Callable[[bool], None]) -> None:
        """Thread: every rank moves its share; done(False) if any failed."""
        try:
            ok = self._on_every_rank(task)
        except Exception as error:  # a transfer's failure is that transfer's
            logger.warning("KV transfer %s failed: %r", task.plan.group_name, error)
            ok = False
        done(ok)

    def _on_every_rank(self, task: TransferTask) -> bool:
        executor = self.engine.executor
        ok = run_transfer(task.plan, 0, executor.runner.kv_caches, self.groups, executor.device)
        if self.world_size == 1:
            return ok
        return task.wait_for_ranks(self.world_size) and ok


class _FetchFailed(Exception):
    pass
