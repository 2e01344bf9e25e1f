"""The engine on rank 0: requests in, one scheduled step at a time, outputs out.

A step: the scheduler picks tokens under the KV and token budgets -> the plan is
broadcast -> every rank runs the model (DCP attention inside) -> rank 0 samples
-> sequences that stop release their blocks.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import torch

from kvshard.config import EngineConfig
from kvshard.engine.model_runner import HEARTBEAT, ModelRunner, StepPlan, configure_cpu
from kvshard.engine.sampler import sample, top_logprobs
from kvshard.engine.scheduler import ScheduledBatch, Scheduler
from kvshard.engine.sequence import Sequence
from kvshard.engine.workers import LocalRanks, RankDiedError, pick_device
from kvshard.kv.block_pool import BlockPool
from kvshard.outputs import CompletionOutput, RequestOutput
from kvshard.parallel import broadcast_from_driver, exchange_heartbeat, init_parallel, shutdown_parallel
from kvshard.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine cannot run another step (a rank died or a collective failed)."""


@dataclass
class EngineStats:
    """Counters and gauges for logs and /metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    # per DCP rank: tokens of live requests stored there (the engine's own accounting)
    kv_tokens_per_dcp_rank: list[int] = field(default_factory=list)
    # prefix cache: tokens of admitted requests looked up and found; blocks holding a cached prefix (per rank)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_blocks_cached: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    stream: bool
    arrival_time: float


class LLMEngine:
    def __init__(self, config: EngineConfig, master: tuple[str, int] | None = None) -> None:
        """Start every rank. `master` (host, port) is given when a launcher (torchrun) started the other ranks."""
        self.config = config
        world = config.parallel.world_size
        configure_cpu(world)
        self.local_ranks = LocalRanks(config) if world > 1 and master is None else None
        check_peers = None
        if self.local_ranks is not None:
            master, check_peers = self.local_ranks.master, self.local_ranks.check_alive
        self.device = pick_device(0)
        try:
            self.parallel = init_parallel(config.parallel, 0, master or ("", 0), self.device, check_peers)
        except Exception as error:
            dead = self._name_dead_rank() if not isinstance(error, RankDiedError) else None
            if self.local_ranks is not None:
                self.local_ranks.join(timeout=5)
            if dead is not None:  # say which rank, not just which socket broke
                raise RankDiedError(f"{dead} while the ranks were connecting") from error
            raise
        except BaseException:
            if self.local_ranks is not None:
                self.local_ranks.join(timeout=5)
            raise
        self._dead_reason: str | None = None
        self._closed = False
        self._last_contact = time.monotonic()  # of the last plan every rank received
        try:
            self.runner = ModelRunner(config, self.parallel, self.device)
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = load_tokenizer(config)
        self.layout = config.dcp_layout
        self.pool = BlockPool(config.num_kv_blocks)
        self.scheduler = Scheduler(config.scheduler, self.pool, self.layout, config.cache.enable_prefix_caching)
        self.requests: dict[str, _Request] = {}
        self.default_generator = torch.Generator().manual_seed(config.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps = 0
        self._lock = threading.RLock()  # add/abort may come from other threads than step

    # --- requests ---------------------------------------------------------------------
    def validate_prompt(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and check a prompt; ValueError says what is wrong."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.config.model.hf_config.vocab_size
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not token_ids:
            raise ValueError("prompt is empty")
        limit = self.config.scheduler.max_model_len
        wanted = len(token_ids) + (params.max_tokens or 1)
        if len(token_ids) >= limit or (params.max_tokens is not None and wanted > limit):
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested {wanted} tokens "
                f"({len(token_ids)} in the prompt, {params.max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens."
            )
        return token_ids

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, stream: bool = False
    ) -> None:
        params.validate()
        token_ids = self.validate_prompt(prompt, params)
        with self._lock:
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            seqs = []
            for index in range(params.n):
                generator = None
                if params.seed is not None:
                    generator = torch.Generator().manual_seed(params.seed + index)
                seqs.append(Sequence(request_id, index, token_ids, params, generator))
            self.requests[request_id] = _Request(
                request_id, prompt if isinstance(prompt, str) else None, token_ids, seqs, stream, time.monotonic()
            )
            for seq in seqs:
                self.scheduler.add(seq)
            self.prompt_tokens_total += len(token_ids) * params.n

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown or finished ids are ignored."""
        with self._lock:
            request = self.requests.pop(request_id, None)
            if request is None:
                return
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return an output for every request that advanced or finished."""
        self._check_alive()
        with self._lock:
            batch = self.scheduler.schedule()
            if batch is None:
                return []
            plan = _plan(batch)
            self._last_contact = time.monotonic()
            try:
                broadcast_from_driver(plan, self.parallel)
                logits = self.runner.execute(plan)
            except Exception as error:
                self._dead_reason = self._name_dead_rank() or f"a collective failed: {error}"
                raise EngineDeadError(self._dead_reason) from error
            self.steps += 1
            self.scheduler.mark_computed(batch)
            sampled = [s for s, do in zip(batch.seqs, batch.sample) if do]
            return self._process_samples(sampled, logits)

    def _process_samples(self, seqs: list[Sequence], logits: torch.Tensor | None) -> list[RequestOutput]:
        if not seqs:
            return []
        logits = logits.cpu()  # sampling and per-request generators live on the host
        tokens = sample(logits, seqs, self.default_generator)
        logprobs = top_logprobs(logits, tokens, [s.params.logprobs for s in seqs]) if any(
            s.params.logprobs is not None for s in seqs
        ) else [None] * len(seqs)
        touched: dict[str, _Request] = {}
        for seq, token, entry in zip(seqs, tokens, logprobs):
            seq.output_token_ids.append(token)
            if entry is not None:
                seq.output_logprobs.append(entry)
            self.generation_tokens_total += 1
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            touched[seq.request_id] = self.requests[seq.request_id]
        outputs = []
        for request in touched.values():
            output = self._output(request)
            if output.finished:
                del self.requests[request.request_id]
            outputs.append(output)
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if params.stop:
            seq.text = self.decode(seq.output_token_ids)
            for stop in params.stop:
                cut = seq.text.find(stop)
                if cut != -1:
                    seq.text = seq.text[:cut]
                    return "stop"
        if params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.config.scheduler.max_model_len:
            return "length"
        return None

    def _output(self, request: _Request) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            # with stop strings the text is kept current (and cut) by _stop_reason
            if (request.stream or seq.is_finished) and not seq.params.stop:
                seq.text = self.decode(seq.output_token_ids)
            completions.append(CompletionOutput(
                index=seq.index, text=seq.text, token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason,
                logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            ))
        finished = all(seq.is_finished for seq in request.seqs)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished)

    @property
    def eos_token_ids(self) -> set[int]:
        eos = self.config.model.hf_config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def heartbeat(self, every_s: float = 1.0) -> None:
        """Send an empty plan to every rank (at most every `every_s`), so a rank that died while
        the engine idles is found now, also one that no local process handle can see."""
        if self.parallel.world_size == 1 or time.monotonic() - self._last_contact < every_s:
            return
        self._check_alive()
        self._last_contact = time.monotonic()
        with self._lock:
            try:
                broadcast_from_driver(HEARTBEAT, self.parallel)
                exchange_heartbeat(self.parallel)
            except Exception as error:
                self._dead_reason = self._name_dead_rank() or f"a rank stopped answering: {error}"
                raise EngineDeadError(self._dead_reason) from error

    # --- health and accounting -------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead_reason is None and self.local_ranks is not None:
            try:
                self.local_ranks.check_alive()
            except RankDiedError as error:
                self._dead_reason = str(error)
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    def _name_dead_rank(self, wait_s: float = 1.0) -> str | None:
        """A peer's death breaks the collective a moment before its process can be reaped: wait briefly to name it."""
        if self.local_ranks is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.local_ranks.check_alive()
            except RankDiedError as error:
                return str(error)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot step, or None while every rank is alive."""
        try:
            self._check_alive()
        except EngineDeadError:
            pass
        return self._dead_reason

    def stats(self) -> EngineStats:
        with self._lock:
            n = self.config.parallel.decode_context_parallel_size
            per_rank = [0] * n
            for seq in self.scheduler.running:
                for r in range(n):
                    per_rank[r] += self.layout.local_len(seq.num_computed_tokens, r)
            return EngineStats(
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                kv_blocks_used=self.pool.num_used,
                kv_blocks_total=self.pool.num_blocks,
                num_preemptions=self.scheduler.num_preemptions,
                prompt_tokens=self.prompt_tokens_total,
                generation_tokens=self.generation_tokens_total,
                steps=self.steps,
                kv_tokens_per_dcp_rank=per_rank,
                prefix_cache_queries=self.scheduler.prefix_cache_queries,
                prefix_cache_hits=self.scheduler.prefix_cache_hits,
                kv_blocks_cached=self.pool.num_cached,
            )

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._dead_reason is None and self.parallel.world_size > 1:
            try:
                broadcast_from_driver(None, self.parallel)
            except Exception:
                pass
        if self.local_ranks is not None:
            self.local_ranks.join(timeout=10)
        shutdown_parallel(self.parallel)


def _plan(batch: ScheduledBatch) -> StepPlan:
    token_ids: list[int] = []
    sample_rows: list[int] = []
    for seq, ctx, n, do_sample in zip(batch.seqs, batch.context_lens, batch.query_lens, batch.sample):
        token_ids.extend(seq.all_token_ids[ctx : ctx + n])
        if do_sample:
            sample_rows.append(len(token_ids) - 1)
    return StepPlan(
        token_ids=token_ids,
        query_lens=batch.query_lens,
        context_lens=batch.context_lens,
        block_tables=[list(s.block_table) for s in batch.seqs],
        sample_rows=sample_rows,
    )


def load_tokenizer(config: EngineConfig):
    path = config.model.path
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None  # token ids in, token ids out
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
