"""The engine behind the server: one engine-loop thread, one asyncio queue per request.

`LLMEngine` is driven by a single thread that owns it: it applies the adds and
aborts that handlers queued, runs a step whenever work is pending, and hands each
step's outputs to the waiting handlers on the event loop. Handlers never take the
engine's lock, so a slow step never stalls the HTTP side.

When a rank dies or hangs (the step raises, or the watchdog on the event loop
finds the engine's dead reason set while the loop waits) or the loop stops,
every request still open, running or waiting, gets the reason as an
`EngineDeadError`, and new requests are refused with it: nobody hangs. Why the
engine died is recorded once, by the engine (`LLMEngine.dead_reason`), and
logged once. Once the loop has stopped, the requests the engine still holds are
aborted (their KV blocks go back) and the metrics recorded once more, so that
/metrics shows what is true: no request running, no KV in use, and the
requests that failed counted as finished with "error" ("abort" for those a
shutdown ended).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvshard.engine.llm_engine import EngineDeadError, LLMEngine
from kvshard.errors import SERVER_STOPPING
from kvshard.metrics import ServerMetrics
from kvshard.outputs import RequestOutput
from kvshard.sampling_params import SamplingParams, StructuredOutputsParams
from kvshard.structured.manager import COMPILE_TIMEOUT_S, too_slow

logger = logging.getLogger("kvshard.engine")

# How often the watchdog looks at the rank processes, and how long an idle loop sleeps.
HEALTH_CHECK_S = 0.2


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool


@dataclass
class _Abort:
    request_id: str


class _Wake:
    """Makes the loop look for work now (a KV transfer asked for over HTTP)."""


@dataclass
class _RequestState:
    """One open request: where its outputs go, and when its tokens came (for the latency metrics)."""

    queue: asyncio.Queue
    num_seqs: int
    arrival: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None
    num_tokens: int = 0
    # each sequence's finish reason as last delivered (None: running): a request that ends early (aborted, failed)
    # counts the sequences that had finished already under their own reason
    finish_reasons: list[str | None] = field(default_factory=list)

    def reasons_if_ended(self, reason: str) -> list[str]:
        """The finish reasons of its sequences if the request ended now with `reason`."""
        known = self.finish_reasons or [None] * self.num_seqs
        return [finished or reason for finished in known]


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue[_Add | _Abort | _Wake | None] = queue.SimpleQueue()
        self._requests: dict[str, _RequestState] = {}
        self._lock = threading.Lock()  # guards _requests and _refusal
        self._refusal: str | None = None  # why new requests are refused: death or shutdown
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._watchdog: asyncio.Task | None = None
        metrics.record_stats(engine.stats())

    # --- life cycle (event loop side) ---------------------------------------------------
    def start(self) -> None:
        """Start the engine-loop thread; call from the event loop the handlers run on."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvshard-engine-loop", daemon=True)
        self._thread.start()
        self._watchdog = asyncio.create_task(self._watch_ranks())

    def shutdown(self) -> None:
        """Stop the loop (open requests get an error), then stop every rank."""
        self._stopping.set()
        self._commands.put(None)
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._thread is not None:
            self._thread.join()
        self.engine.shutdown()

    async def _watch_ranks(self) -> None:
        """Notice a dead or hung rank even while the loop is idle or stuck in a collective."""
        while self._refusal is None:
            await asyncio.sleep(HEALTH_CHECK_S)
            reason = self.engine.dead_reason
            if reason is not None:
                self._fail(reason)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine died (a rank, a collective, a bug), or None while it is healthy."""
        return self.engine.dead_reason

    def refuse(self, reason: str) -> None:
        """From now on every request, open or new, gets an error with `reason` (the server is stopping), and the
        loop stops; the ranks stay until `shutdown`."""
        self._fail(reason, dead=False)

    @property
    def refusal(self) -> str | None:
        """Why requests are refused now (the engine died or the server is stopping), or None."""
        return self._refusal

    # --- requests (event loop side) -----------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (cumulative) until it finishes; leaving early aborts it.

        Raises EngineDeadError, at once or mid-way, when the engine cannot serve it.
        """
        state = _RequestState(asyncio.Queue(), params.n)
        with self._lock:
            if self._refusal is not None:
                raise EngineDeadError(self._refusal)
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._requests[request_id] = state
        self._commands.put(_Add(request_id, prompt_token_ids, params, stream))
        finished = False
        try:
            while not finished:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the client left, or the engine failed: free the KV blocks
                self.abort(request_id)

    async def check_structured_outputs(self, params: SamplingParams | StructuredOutputsParams) -> None:
        """Compile the request's output constraint off the engine thread (or find it compiled) and wait for it
        without blocking the event loop: ValueError naming the field when it does not compile, is too large
        or takes too long. Await it before `generate`, so a bad constraint never reaches the engine loop."""
        constraint = params.structured_outputs if isinstance(params, SamplingParams) else params
        if constraint is None:
            return
        future = self.engine.structured.submit(constraint)  # shared with other requests: never cancelled here
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), COMPILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise too_slow(constraint) from None

    def wake(self) -> None:
        self._commands.put(_Wake())

    def abort(self, request_id: str) -> None:
        with self._lock:
            state = self._requests.pop(request_id, None)
        if state is None:
            return
        self.metrics.observe_finished(state.reasons_if_ended("abort"), time.monotonic() - state.arrival)
        self._commands.put(_Abort(request_id))

    # --- the loop (engine thread) ---------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set() and self._refusal is None:
                busy = self.engine.has_unfinished_requests()
                if not self._apply_commands(wait=not busy):
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    # counted before delivered: a client that scrapes /metrics after its answer sees its tokens
                    self.metrics.record_stats(self.engine.stats())
                    self._deliver(outputs)
                else:
                    self.engine.heartbeat()  # an idle server still notices a rank lost on another node
                    self.metrics.record_stats(self.engine.stats())
        except EngineDeadError as error:
            self._fail(str(error))
        except Exception as error:  # a bug in the engine: every client must still get an answer
            logger.exception("engine loop failed")
            self._fail(f"the engine loop failed: {error!r}")
        else:
            self._fail(SERVER_STOPPING, dead=False)
        finally:
            self._release_requests()

    def _release_requests(self) -> None:
        """The loop has stopped and no step runs: abort what the engine still holds (its clients got their error
        already), so that the KV blocks go back and the last stats recorded say so, not what the last step left."""
        try:
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)
            self.metrics.record_stats(self.engine.stats())
        except Exception:  # the clients have their answers: a failure here must not hide why the loop stopped
            logger.exception("releasing the requests of a stopped engine loop failed")

    def _apply_commands(self, wait: bool) -> bool:
        """Apply queued adds and aborts (waiting a little for one when idle); False means stop."""
        try:
            command = self._commands.get(timeout=HEALTH_CHECK_S) if wait else self._commands.get_nowait()
        except queue.Empty:
            return True
        while command is not None:
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params, command.stream)
        except ValueError as error:  # handlers validate first; a late error still reaches the client
            with self._lock:
                state = self._requests.pop(command.request_id, None)
            if state is not None:
                self._loop.call_soon_threadsafe(state.queue.put_nowait, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        deliveries = []
        with self._lock:
            for output in outputs:
                state = self._requests.get(output.request_id)
                if state is None:
                    continue  # aborted by its client while the step ran
                self._observe_tokens(state, output, now)
                state.finish_reasons = [c.finish_reason for c in output.outputs]
                if output.finished:
                    del self._requests[output.request_id]
                    self.metrics.observe_finished([c.finish_reason for c in output.outputs], now - state.arrival)
                deliveries.append((state.queue, output))
        if deliveries:
            self._loop.call_soon_threadsafe(_put_all, deliveries)

    def _observe_tokens(self, state: _RequestState, output: RequestOutput, now: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        if num_tokens == state.num_tokens:
            return
        if state.last_token_time is None:
            self.metrics.ttft.observe(now - state.arrival)
        else:
            self.metrics.itl.observe(now - state.last_token_time)
        state.last_token_time, state.num_tokens = now, num_tokens

    def _fail(self, reason: str, dead: bool = True) -> None:
        """From now on every request, open or new, gets an error with the first reason given; the open ones
        count as finished with "error" (with "abort" when the server is stopping)."""
        if dead:
            reason = self.engine.record_death(reason)
        with self._lock:
            first = self._refusal is None
            if first:
                self._refusal = reason
            reason = self._refusal
            open_requests = list(self._requests.values())
            self._requests.clear()
        if first and dead:  # whichever noticed it (the loop or the watchdog), said once
            logger.error("engine is dead: %s", reason)
        now = time.monotonic()
        for state in open_requests:
            self.metrics.observe_finished(state.reasons_if_ended("error" if dead else "abort"), now - state.arrival)
        if open_requests:
            error = EngineDeadError(reason)
            self._loop.call_soon_threadsafe(_put_all, [(state.queue, error) for state in open_requests])


def _put_all(deliveries: list[tuple[asyncio.Queue, object]]) -> None:
    for target, item in deliveries:
        target.put_nowait(item)
