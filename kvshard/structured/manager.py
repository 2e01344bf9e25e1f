"""Compiling constraints off the engine thread, and masking the rows that sample.

`StructuredOutputManager` compiles each request's `StructuredOutputsParams` in a small thread pool, at most
once per `StructuredOutputsParams.key()` (a bounded LRU cache of futures, failures included), so the engine
thread never waits for a compile: a request is scheduled once its grammar is ready (the scheduler skips it
until then) and fails alone, with the compiler's message, when it does not compile. `check` waits for the
compile (the server and `LLM.generate` call it before a request reaches the engine loop, so a bad schema is a
400 or a ValueError there).

`apply_masks` runs on rank 0 inside the sampler's logits processing: each constrained row gets -inf where its
grammar forbids the token; a verification row of speculative decoding is masked as the grammar stands after
the drafts before it (accepted for the fill, then rolled back).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict

import torch

from kvshard.sampling_params import StructuredOutputsParams
from kvshard.structured.backend import Backend, Grammar

COMPILE_TIMEOUT_S = 30.0  # a constraint that takes longer to compile is refused
MAX_COMPILED_BYTES = 128 << 20  # a compiled grammar larger than this is refused ("too large")
CACHE_ENTRIES = 256
CACHE_BYTES = 1 << 30
BACKENDS = ("xgrammar",)


def _make_backend(name: str, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> Backend:
    if name == "xgrammar":
        from kvshard.structured.xgrammar_backend import XgrammarBackend

        return XgrammarBackend(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"unknown structured outputs backend {name!r} (known: {', '.join(BACKENDS)})")


class StructuredOutputManager:
    """One per engine, on rank 0. `vocab_size`: the model's (its logits' width); `stop_token_ids`: the EOS."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, backend: str = "xgrammar",
                 max_workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.backend_name = backend
        self._backend: Backend | None = None  # made on first use (the vocabulary's tables take a moment)
        self._backend_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="kvshard-grammar")
        self._cache: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._cache_lock = threading.Lock()

    @property
    def backend(self) -> Backend:
        with self._backend_lock:
            if self._backend is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs needs the model's tokenizer, and this model has none")
                self._backend = _make_backend(self.backend_name, self.tokenizer, self.vocab_size,
                                              self.stop_token_ids)
            return self._backend

    # --- compiling (any thread) -------------------------------------------------------------
    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The future of the compiled grammar (started now, or shared with an earlier request)."""
        key = params.key()
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            self._evict()
        return future

    def _compile(self, params: StructuredOutputsParams):
        try:
            backend = self.backend
            compiled = backend.compile(params)
        except ValueError:
            raise
        except Exception as error:  # the backend's own failure still names the field
            raise ValueError(f"structured_outputs.{params.kind()} could not be compiled: {error}") from None
        size = backend.compiled_size_bytes(compiled)
        if size > MAX_COMPILED_BYTES:
            raise ValueError(f"structured_outputs.{params.kind()} is too large: its compiled grammar takes "
                             f"{size / (1 << 20):.1f} MiB, more than the {MAX_COMPILED_BYTES >> 20} MiB allowed")
        return compiled

    def _evict(self) -> None:
        """Oldest first, never a compile still running: at most CACHE_ENTRIES and about CACHE_BYTES."""
        def size(future) -> int:
            if not future.done() or future.exception() is not None:
                return 0
            return self._backend.compiled_size_bytes(future.result())

        total = sum(size(f) for f in self._cache.values())
        for key in list(self._cache):
            if len(self._cache) <= CACHE_ENTRIES and total <= CACHE_BYTES:
                break
            future = self._cache[key]
            if future.done():
                total -= size(future)
                del self._cache[key]

    def check(self, params: StructuredOutputsParams, timeout: float = COMPILE_TIMEOUT_S):
        """Wait for the compiled grammar; ValueError naming the field when it does not compile in time."""
        return result(self.submit(params), params, timeout)

    @staticmethod
    def wait_any(futures, timeout: float) -> None:
        concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def new_grammar(self, compiled) -> Grammar:
        grammar = self.backend.new_grammar(compiled)
        grammar.backend = self._backend
        return grammar

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def result(future: concurrent.futures.Future, params: StructuredOutputsParams, timeout: float):
    """The compiled grammar, waiting up to `timeout`; ValueError naming the field otherwise."""
    try:
        return future.result(timeout=timeout)
    except (concurrent.futures.TimeoutError, TimeoutError):
        raise too_slow(params) from None


def too_slow(params: StructuredOutputsParams) -> ValueError:
    return ValueError(f"structured_outputs.{params.kind()} did not compile within {COMPILE_TIMEOUT_S:g} s "
                      "(too large or too complex)")


def timed_out(since: float) -> bool:
    return time.monotonic() - since > COMPILE_TIMEOUT_S


def apply_masks(logits: torch.Tensor, seqs, drafts_before: list[list[int]] | None = None) -> None:
    """In place: logits [b, V] row i (for seqs[i], after its output and `drafts_before[i]`) gets -inf where
    seqs[i].grammar forbids the token; rows of unconstrained sequences are untouched.

    The rows of one sequence may follow one another with longer and longer drafts before them (a
    verification step): its grammar accepts each draft in turn for the fills, and is rolled back after. A row
    after a draft the grammar refuses, or after a drafted stop token that ended the grammar (which has no mask
    to give then), is left as it is: verification rejects that draft or ends the request there, so the row is
    never used. Token ids past the tokenizer's vocabulary (a padded vocabulary) are never allowed.
    """
    rows = [i for i, seq in enumerate(seqs) if getattr(seq, "grammar", None) is not None]
    if not rows:
        return
    backend: Backend = seqs[rows[0]].grammar.backend
    bitmask = backend.allocate_bitmask(logits.shape[0])
    filled: list[int] = []
    advanced: dict[int, tuple[Grammar, list[int]]] = {}  # by id(grammar): the drafts it accepted for the fills
    try:
        for i in rows:
            grammar = seqs[i].grammar
            wanted = drafts_before[i] if drafts_before else []
            _, taken = advanced.setdefault(id(grammar), (grammar, []))
            common = 0
            while common < min(len(taken), len(wanted)) and taken[common] == wanted[common]:
                common += 1
            grammar.rollback(len(taken) - common)
            del taken[common:]
            for token in wanted[common:]:
                if not grammar.accept_token(token):
                    break
                taken.append(token)
            if len(taken) == len(wanted) and not grammar.is_terminated():
                grammar.fill_bitmask(bitmask, i)
                filled.append(i)
    finally:
        for grammar, taken in advanced.values():
            grammar.rollback(len(taken))
    if filled:
        backend.apply_bitmask(logits, bitmask, filled)
        if logits.shape[1] > backend.vocab_size:
            logits[filled, backend.vocab_size:] = float("-inf")
