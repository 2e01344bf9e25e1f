"""Rank 0's side of disaggregated prefill/decode: which blocks are held, fetched, and when.

Producer: a request that asks for it (`kv_transfer_params.do_remote_decode`) keeps
its KV blocks when it finishes (one more reference in the pool), under the
transfer id the proxy gave, until a consumer fetches them or `hold_timeout_s`
passes. A consumer's fetch arrives over HTTP (`serve_pull`), is answered at once
with the producer's layout and blocks, and the send runs on the engine thread
between two steps.

Consumer: a request with `kv_transfer_params.do_remote_prefill` waits in the
queue until, between two steps, its blocks are reserved, the producer is asked
over HTTP, and every rank receives its share; it then joins the running batch
with all prompt tokens but the last computed, so its first step computes that
token and samples the first output token as a colocated engine would. If the
fetch fails, its blocks go back to the pool and the request ends with an error.
A preempted request recomputes its prompt: the producer no longer holds the KV.

Every transfer runs on all ranks of both instances (disagg/transfer.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import httpx
import torch.distributed as dist

from kvshard.disagg.config import KVTransferConfig
from kvshard.disagg.transfer import KVTransferPlan, PairGroups, transfer_on_rank
from kvshard.engine.sequence import Sequence, SequenceStatus
from kvshard.kv.layout import DCPLayout
from kvshard.kv.relayout import InstanceLayout, kv_heads_of_ranks
from kvshard.outputs import RequestOutput
from kvshard.parallel import broadcast_from_driver

if TYPE_CHECKING:
    from kvshard.engine.llm_engine import LLMEngine

logger = logging.getLogger("kvshard.disagg")


class PullRefused(Exception):
    """A consumer asked for KV this producer cannot send (unknown, expired, other model)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Hold:
    blocks: list[int]
    num_tokens: int  # tokens whose KV the blocks hold
    deadline: float
    claimed: bool = False  # a consumer is fetching it: the send frees it, not the timeout


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
    return InstanceLayout(DCPLayout(raw["block_size"], raw["dcp"], raw["interleave"]),
                          tuple(range(a, b) for a, b in raw["rank_heads"]))


class KVConnector:
    """Attached to an `LLMEngine` as `engine.kv_connector`; the engine calls `on_finish`,
    `before_schedule` and `has_pending` from its step (engine thread, under its lock)."""

    def __init__(self, engine: LLMEngine, config: KVTransferConfig) -> None:
        self.engine = engine
        self.config = config
        self.layout = instance_layout(engine)
        self.signature = model_signature(engine)
        self.groups = PairGroups()
        self.wake: Callable[[], None] = lambda: None  # set by the server: makes its engine loop look for work
        self._lock = threading.Lock()  # holds and sends are also touched by HTTP handlers
        self._holds: dict[str, _Hold] = {}
        self._sends: deque[tuple[KVTransferPlan, str]] = deque()
        self._generation: dict[str, int] = {}  # consumer: per producer URL, bumped after a failed transfer
        self.store = None
        if config.is_producer:
            # the rendezvous of every pair group this producer joins; consumer ranks connect as clients
            self.store = dist.TCPStore(config.kv_ip, config.kv_port, is_master=True, wait_for_workers=False)
        engine.kv_connector = self

    @property
    def store_address(self) -> tuple[str, int]:
        return self.config.kv_ip, self.store.port

    def info(self) -> dict:
        """This instance as another one sees it: role, id, layout and the model's KV signature."""
        return {"kv_role": self.config.kv_role, "engine_id": self.config.engine_id,
                "layout": _layout_json(self.layout), "signature": self.signature}

    # --- engine hooks --------------------------------------------------------------------
    def has_pending(self) -> bool:
        """Work for the engine thread even when no request runs: a send, or a hold that expired."""
        now = time.monotonic()
        with self._lock:
            return bool(self._sends) or any(not h.claimed and h.deadline <= now for h in self._holds.values())

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
            self.engine.pool.take(seq.block_table)  # the finish drops the request's reference, this one stays
            self._holds[transfer_id] = _Hold(list(seq.block_table), seq.num_computed_tokens,
                                             time.monotonic() + self.config.hold_timeout_s)

    def before_schedule(self) -> list[RequestOutput]:
        """Run what waits for the engine thread; outputs of consumer requests whose fetch failed."""
        self._expire_holds()
        while True:
            with self._lock:
                if not self._sends:
                    break
                plan, transfer_id = self._sends.popleft()
            ok = self._on_every_rank(plan)
            with self._lock:
                hold = self._holds.pop(transfer_id)
            self.engine.pool.free(hold.blocks)
            if not ok:
                logger.warning("sending the KV of %s failed; its blocks are freed", transfer_id)
        if self.config.is_producer:
            return []
        failed = []
        for seq in [s for s in self.engine.scheduler.waiting if (s.params.kv_transfer_params or {})
                    .get("do_remote_prefill")]:
            error = self._fetch(seq)
            if error == "later":
                break
            if error is not None:
                failed.append(self._fail(seq, error))
        return failed

    # --- producer -----------------------------------------------------------------------
    def _expire_holds(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [t for t, h in self._holds.items() if not h.claimed and h.deadline <= now]
            blocks = [self._holds.pop(t).blocks for t in expired]
        for transfer_id, held in zip(expired, blocks):
            logger.warning("no consumer fetched the KV of %s within %g s; its blocks are freed", transfer_id,
                           self.config.hold_timeout_s)
            self.engine.pool.free(held)

    def serve_pull(self, body: dict) -> dict:
        """Producer, HTTP thread: a consumer asks for a held request's KV. Answers with what the
        consumer needs to run the same plan, and queues the send for the engine thread."""
        if not self.config.is_producer:
            raise PullRefused(400, "this instance is not a kv_producer")
        if body.get("signature") != self.signature:
            raise PullRefused(400, f"the consumer's model {body.get('signature')} differs from the producer's "
                                   f"{self.signature}")
        transfer_id = str(body["transfer_id"])
        with self._lock:
            hold = self._holds.get(transfer_id)
            if hold is None or hold.claimed:
                raise PullRefused(404, f"no KV is held for transfer {transfer_id!r} (never prefilled here, "
                                       "already fetched, or expired)")
            num_tokens = int(body["num_tokens"])
            if not 0 <= num_tokens <= hold.num_tokens:
                raise PullRefused(400, f"asked for {num_tokens} tokens, {hold.num_tokens} are held")
            hold.claimed = True
            group_name = f"{self.config.engine_id}/{body['consumer_id']}/{int(body['generation'])}"
            plan = KVTransferPlan(group_name, self.store_address, True, self.layout, hold.blocks,
                                  _layout_from_json(body["layout"]), list(body["blocks"]), num_tokens,
                                  self.config.transfer_timeout_s)
            self._sends.append((plan, transfer_id))
        self.wake()
        return {"group_name": group_name, "store": list(self.store_address), "layout": _layout_json(self.layout),
                "blocks": hold.blocks}

    # --- consumer -----------------------------------------------------------------------
    def _fetch(self, seq: Sequence) -> str | None:
        """Receive `seq`'s prompt KV (all but the last token) and move it to the running batch.
        Returns None on success, "later" when blocks or batch places are short, or why it failed."""
        engine, params = self.engine, seq.params.kv_transfer_params
        num_tokens = seq.num_tokens - 1
        count = engine.layout.num_virtual_blocks(seq.num_tokens)
        if count > engine.pool.num_free or len(engine.scheduler.running) >= engine.config.scheduler.max_num_seqs:
            return "later"
        seq.params.kv_transfer_params = None  # fetched once: after a preemption the prompt is recomputed
        url = f"http://{params['remote_host']}:{params['remote_port']}"
        generation = self._generation.setdefault(url, 0)
        blocks = engine.pool.allocate(count)
        try:
            answer = httpx.post(f"{url}/kv_transfer/pull", timeout=self.config.transfer_timeout_s, json={
                "transfer_id": params["transfer_id"], "consumer_id": self.config.engine_id,
                "generation": generation, "num_tokens": num_tokens, "layout": _layout_json(self.layout),
                "blocks": blocks, "signature": self.signature})
        except httpx.HTTPError as error:
            engine.pool.free(blocks)
            return f"the producer at {url} cannot be reached: {error}"
        if answer.status_code != 200:
            engine.pool.free(blocks)
            try:
                why = answer.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                why = f"status {answer.status_code}: {answer.text[:200]}"
            return f"the producer at {url} refused: {why}"
        reply = answer.json()
        plan = KVTransferPlan(reply["group_name"], tuple(reply["store"]), False, _layout_from_json(reply["layout"]),
                              reply["blocks"], self.layout, blocks, num_tokens, self.config.transfer_timeout_s)
        if not self._on_every_rank(plan):
            engine.pool.free(blocks)
            self._generation[url] = generation + 1  # the old group is broken on every rank that used it
            return f"receiving the KV from the producer at {url} failed (it died or timed out)"
        engine.scheduler.waiting.remove(seq)
        seq.block_table, seq.num_computed_tokens = blocks, num_tokens
        seq.status = SequenceStatus.RUNNING
        engine.scheduler.running.append(seq)
        return None

    def _fail(self, seq: Sequence, reason: str) -> RequestOutput:
        logger.warning("request %s: %s", seq.request_id, reason)
        request = self.engine.requests.pop(seq.request_id)
        request.error = f"fetching the prompt's KV failed: {reason}"
        self.engine.scheduler.finish(seq, "error")
        return self.engine.output_processor.output(request)

    # --- both ---------------------------------------------------------------------------
    def _on_every_rank(self, plan: KVTransferPlan) -> bool:
        executor = self.engine.executor
        executor.check_alive()
        broadcast_from_driver(plan, executor.parallel)
        return transfer_on_rank(plan, executor.parallel, executor.runner.kv_caches, self.groups, executor.device)
