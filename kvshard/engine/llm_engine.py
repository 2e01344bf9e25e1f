"""The engine on rank 0: requests in, one scheduled step at a time, outputs out.

A step (`LLMEngine.step`) is schedule -> execute -> update from output: the
scheduler picks tokens under the KV and token budgets (with speculative decoding,
the proposer first asks room for drafts and then fills them in: one `Proposer`
whatever the method, kvshard/spec_decode/proposer.py) -> each request's rows in
the step are laid out once (`StepRows`) -> the executor runs the step's plan on
every rank (DCP attention inside) -> rank 0 records prompt logprobs and samples,
verifying drafts where there are some (`sampler.verify_drafts`, one path for
every row) -> the output processor appends the tokens, detokenizes and applies
the stop conditions -> sequences that stop release their blocks.
"""

from __future__ import annotations

import operator
import os
import threading
import time

import torch

from kvshard.config import EngineConfig
from kvshard.engine.executor import EngineDeadError, Executor
from kvshard.engine.kv_connector import KVConnectorBase
from kvshard.engine.output_processor import OutputProcessor, Request
from kvshard.engine.process_setup import release_openmp_threads
from kvshard.engine.sampler import top_logprobs, verify_drafts
from kvshard.engine.scheduler import ScheduledBatch, Scheduler
from kvshard.engine.sequence import Sequence
from kvshard.engine.step_plan import StepPlan, StepRows
from kvshard.engine.stats import EngineStats
from kvshard.kv.block_pool import BlockPool
from kvshard.outputs import RequestOutput
from kvshard.sampling_params import SamplingParams, StructuredOutputsParams
from kvshard.spec_decode.proposer import Proposer, make_proposer
from kvshard.structured.manager import StructuredOutputManager, result, timed_out

__all__ = ["EngineDeadError", "LLMEngine"]


class LLMEngine:
    """Scheduler + executor + output processing: requests in, one scheduled step at a time, outputs out."""

    def __init__(self, config: EngineConfig, master: tuple[str, int] | None = None) -> None:
        """Start every rank. `master` (host, port) is given when a launcher (torchrun) started the other ranks."""
        self.config = config
        self.executor = Executor(config, master)
        try:
            self._set_up(config)
        except BaseException:  # the ranks are up: nothing of a failed start is left running
            if hasattr(self, "structured"):
                self.structured.shutdown()
            self.executor.shutdown()
            raise
        # loading left this thread OpenMP workers; whichever thread steps the engine (the server's loop, a caller's
        # worker thread), its operators' barriers must not sleep beside them (process_setup.release_openmp_threads)
        release_openmp_threads()

    def _set_up(self, config: EngineConfig) -> None:
        """What rank 0 builds once the ranks are up (`__init__`)."""
        self.tokenizer = load_tokenizer(config)
        self.layout = config.dcp_layout
        self.pool = BlockPool(config.num_kv_blocks)
        self.scheduler = Scheduler(config.scheduler, self.pool, self.layout, config.cache.enable_prefix_caching,
                                   fixed_chunks=config.batch_invariant)
        self.output_processor = OutputProcessor(self.tokenizer, config.model.hf_config, config.scheduler.max_model_len)
        # a logprob's token alone as text (vLLM's Logprob.decoded_token), decoded only where a caller reads it
        tokenizer = self.tokenizer
        self._token_text = (lambda token: tokenizer.decode([token])) if tokenizer is not None else None
        self.requests: dict[str, Request] = {}
        # structured outputs: grammars compile off this thread; requests waiting for theirs, by id
        self.structured = StructuredOutputManager(self.tokenizer, config.model.hf_config.vocab_size,
                                                  self.output_processor.eos_token_ids)
        self._compiling: dict[str, tuple] = {}  # request id -> (future, when submitted)
        self.default_generator = torch.Generator().manual_seed(config.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps = 0
        self.prefill_step_seconds = self.decode_step_seconds = 0.0  # EngineStats
        self.speculative = config.speculative
        self.num_speculative_tokens = self.speculative.num_speculative_tokens if self.speculative else 0
        # drafts for decoding requests (n-gram, a draft model, the MTP module; none without speculation)
        self.proposer: Proposer = make_proposer(self.speculative, self.executor, self.default_generator)
        # speculative decoding counters, as EngineStats names them
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_accepted_per_pos = [0] * (self.speculative.num_speculative_tokens if self.speculative else 0)
        self._lock = threading.RLock()  # add/abort may come from other threads than step
        self.kv_connector: KVConnectorBase | None = None  # set by attach_kv_connector (engine/kv_connector.py)

    @property
    def runner(self):
        """Rank 0's model runner (its model and KV cache)."""
        return self.executor.runner

    # --- requests ---------------------------------------------------------------------
    def check_structured_outputs(self, params: SamplingParams | StructuredOutputsParams) -> None:
        """Compile the output constraint (or find it compiled) and wait for it, from any thread but the
        engine's: ValueError naming the field when it does not compile, is too large or takes too long."""
        constraint = params.structured_outputs if isinstance(params, SamplingParams) else params
        if constraint is not None:
            self.structured.check(constraint)

    def validate_prompt(self, prompt: str | list[int], params: SamplingParams,
                        wait_for_grammar: bool = True) -> list[int]:
        """Tokenize and check a prompt, and the output constraint (compiled here unless `wait_for_grammar`
        is False); ValueError says what is wrong."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"the model at {self.config.model.path} has no tokenizer (tokenizer.json, "
                                 "tokenizer_config.json): pass prompts as token ids, or add its tokenizer files")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.config.model.hf_config.vocab_size
            # exact ints (no bools, no floats) within the vocabulary, in C loops: this runs again on the engine
            # thread for every request, and a Python loop took 7 ms per 100K ids there
            if token_ids and not (operator.countOf(map(type, token_ids), int) == len(token_ids)
                                  and min(token_ids) >= 0 and max(token_ids) < vocab):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not token_ids:
            raise ValueError("prompt is empty")
        # bad_words' tokens, the EOS that min_tokens holds back, logit_bias ids within the vocabulary
        params.prepare(self.tokenizer, self.output_processor.eos_token_ids, self.config.model.hf_config.vocab_size)
        limit = self.config.scheduler.max_model_len
        wanted = len(token_ids) + (params.max_tokens or 1)
        if len(token_ids) >= limit or (params.max_tokens is not None and wanted > limit):
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested {wanted} tokens "
                f"({len(token_ids)} in the prompt, {params.max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens."
            )
        if wait_for_grammar:
            self.check_structured_outputs(params)
        return token_ids

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, stream: bool = False
    ) -> None:
        """Queue a request (`stream` is accepted for callers that stream; text is always kept current)."""
        params.validate()
        token_ids = self.validate_prompt(prompt, params, wait_for_grammar=False)  # never waits on this thread
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured.submit(params.structured_outputs)
            if grammar.done() and grammar.exception() is not None:
                raise grammar.exception()
        with self._lock:
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            seqs = []
            for index in range(params.n):
                generator = None
                if params.seed is not None:
                    generator = torch.Generator().manual_seed(params.seed + index)
                seqs.append(Sequence(request_id, index, token_ids, params, generator))
            self.requests[request_id] = Request(
                request_id, prompt if isinstance(prompt, str) else None, token_ids, seqs, time.monotonic()
            )
            for seq in seqs:
                self.scheduler.add(seq)
            if grammar is not None:
                self._compiling[request_id] = (grammar, time.monotonic())
            self.prompt_tokens_total += len(token_ids) * params.n

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown or finished ids are ignored."""
        with self._lock:
            request = self.requests.pop(request_id, None)
            self._compiling.pop(request_id, None)
            if request is None:
                return
            self._finish_all(request, "abort")
            self.output_processor.release(request)

    def _finish_all(self, request: Request, reason: str) -> None:
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or (self.kv_connector is not None and self.kv_connector.has_pending())

    # --- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return an output for every request that advanced or finished."""
        with self._lock:
            started = time.perf_counter()
            failed = self._kv_connector_step() if self.kv_connector is not None else []
            if self._compiling:
                failed += self._start_grammars()
            self._ask_for_drafts()
            batch = self.scheduler.schedule()
            if batch is None:
                if self._compiling:  # nothing else to do: wait a little for a grammar rather than spin
                    self.structured.wait_any([future for future, _ in self._compiling.values()], 0.01)
                self.executor.check_alive()
                return failed
            draft_probs = self.proposer.draft(batch)
            rows = StepRows.from_batch(batch)
            plan = StepPlan.from_batch(batch, rows, self.proposer.target_step(batch, rows),
                                       self.executor.block_tables.changes(batch.seqs))
            logits = self.executor.execute(plan)
            self.steps += 1
            outputs = self._update_from_output(batch, rows, logits, draft_probs)
            seconds = time.perf_counter() - started
            if batch.num_prefill_tokens:
                self.prefill_step_seconds += seconds
            else:
                self.decode_step_seconds += seconds
            return failed + outputs

    def _start_grammars(self) -> list[RequestOutput]:
        """Give the requests whose grammar compiled a matcher per sequence (the scheduler takes them from
        now on); fail, alone, those whose grammar did not compile."""
        outputs = []
        for request_id, (future, since) in list(self._compiling.items()):
            request = self.requests.get(request_id)
            if request is None or not (future.done() or timed_out(since)):
                if request is None:
                    del self._compiling[request_id]
                continue
            del self._compiling[request_id]
            params = request.seqs[0].params
            try:
                compiled = result(future, params.structured_outputs, 0)
                for seq in request.seqs:
                    seq.grammar = self.structured.new_grammar(compiled)
            except Exception as error:
                request.error = str(error)
                self._finish_all(request, "error")
                outputs.append(self.output_processor.output(request))
                del self.requests[request_id]
        return outputs

    def _ask_for_drafts(self) -> None:
        """Let the proposer ask room for drafts for every decoding request, never past max_tokens or
        max_model_len (the token after the drafts must still fit)."""
        k = self.num_speculative_tokens
        if not k:
            return
        for seq in self.scheduler.running:
            if seq.num_uncomputed_tokens != 1:
                continue
            room = self.config.scheduler.max_model_len - seq.num_tokens - 1
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
            seq.num_spec_tokens = self.proposer.wanted_drafts(seq, max(0, min(k, room)))

    def _update_from_output(self, batch: ScheduledBatch, rows: StepRows, logits: torch.Tensor | None,
                            draft_probs: dict[int, torch.Tensor | None]) -> list[RequestOutput]:
        """The step ran: record its prompt logprobs, count its tokens computed, then sample (and verify
        drafts) and hand the new tokens to the output processor."""
        if any(r.prompt_logprobs or r.num_sampled for r in rows.requests):
            logits = logits.cpu()  # [prompt rows + sampled rows, V]; sampling and generators live on the host
        self._take_prompt_logprobs(batch, rows, logits)
        self.scheduler.mark_computed(batch)
        return self._process_samples(batch, rows, logits, draft_probs)

    def _take_prompt_logprobs(self, batch: ScheduledBatch, rows: StepRows, logits: torch.Tensor) -> None:
        """Record the prompt logprobs that this step's prompt rows give."""
        for seq, r in zip(batch.seqs, rows.requests):
            positions = r.prompt_logprobs
            if positions:
                # the logits at position p predict prompt token p + 1
                next_tokens = seq.prompt_token_ids[positions.start + 1 : positions.stop + 1]
                counts = [seq.params.prompt_logprobs] * len(positions)
                seq.prompt_logprobs.extend(top_logprobs(logits[r.logits_start : r.logits_start + len(positions)],
                                                        next_tokens, counts, self._token_text))

    def _process_samples(self, batch: ScheduledBatch, rows: StepRows, logits: torch.Tensor | None,
                         draft_probs: dict[int, torch.Tensor | None]) -> list[RequestOutput]:
        """`draft_probs`: by seq_id, the distributions a draft model drew the drafts from."""
        sampled = [i for i, r in enumerate(rows.requests) if r.num_sampled]
        if not sampled:
            return []
        seqs = [batch.seqs[i] for i in sampled]
        first_rows = [rows.requests[i].sampled_start for i in sampled]  # each one's first row among the logits
        logit_rows = [row for i, first in zip(sampled, first_rows)
                      for row in range(first, first + rows.requests[i].num_sampled)]
        # every row, as they lie, where they are all sampled (a copy of them took 0.7 ms at 32 rows)
        sampled_logits = logits if logit_rows == list(range(logits.shape[0])) else logits[logit_rows]
        outcomes = verify_drafts(sampled_logits, seqs, [batch.drafts[i] for i in sampled], self.default_generator,
                                 [draft_probs.get(seq.seq_id) for seq in seqs] if draft_probs else None)
        sampled = [(batch.seqs[i], batch.drafts[i]) for i in sampled]
        touched: dict[str, Request] = {}
        for i, ((seq, drafts), outcome) in enumerate(zip(sampled, outcomes)):
            request = touched[seq.request_id] = self.requests[seq.request_id]
            if request.error is not None:
                continue  # a sibling sequence of this step already failed the request
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                reason = None
                for offset, token in enumerate(outcome):
                    reason = self._append(seq, token, logits, first_rows[i] + offset)
                    if reason is not None:
                        break
                if drafts:
                    # the drafts appended before the last token were accepted: their K/V count (and their
                    # full blocks are named for the prefix cache) also when that token ends the sequence.
                    # The counters count them alone: drafts verified past a stop are not output, so that
                    # every step gives its request 1 + accepted tokens
                    self._count_drafts(len(drafts), offset)
                    self.scheduler.accept_drafts(seq, offset)
                if reason is not None:
                    self.scheduler.finish(seq, reason)
            except Exception as error:  # this request's sampling or post-processing failed: it alone ends
                request.error = f"generating this request failed: {error}"
                request.invalid_request = bool(getattr(error, "invalid_request", False))  # errors.RequestSettingsError
                self._finish_all(request, "error")
        outputs = []
        for request in touched.values():
            output = self.output_processor.output(request)
            if output.finished:
                del self.requests[request.request_id]
            outputs.append(output)
        return outputs

    def _append(self, seq: Sequence, token: int, logits: torch.Tensor, row: int) -> str | None:
        """logits[row] [V]: the row that gave `token` (read only for logprobs). Returns why `seq` finishes
        with this token, or None; the caller finishes it (after counting the drafts the step accepted)."""
        if seq.params.logprobs is not None:
            entry = top_logprobs(logits[row : row + 1], [token], [seq.params.logprobs], self._token_text)[0]
            seq.output_logprobs.append(entry)
            seq.cumulative_logprob += entry[token]
        self.generation_tokens_total += 1
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            raise ValueError(f"token {token} breaks the output's structured_outputs constraint (min_tokens, "
                             "bad_words or logit_bias left the constraint no token to choose)")
        reason = self.output_processor.append_token(seq, token)
        if reason is None and seq.grammar is not None and seq.grammar.is_terminated():
            reason = "stop"  # the constraint is complete and took its stop token
        return reason

    def _count_drafts(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        for position in range(num_accepted):
            self.spec_accepted_per_pos[position] += 1

    def heartbeat(self, every_s: float = 1.0) -> None:
        """Let the executor check on every rank while no step runs (at most every `every_s`)."""
        with self._lock:
            self.executor.heartbeat(every_s)

    # --- health and accounting -------------------------------------------------------------
    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot step (the first reason recorded), or None while it is healthy."""
        return self.executor.dead_reason

    def record_death(self, reason: str) -> str:
        """The engine cannot go on (e.g. its loop failed): keep the first reason; returns the one kept."""
        return self.executor.record_death(reason)

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
                prefill_step_seconds=self.prefill_step_seconds,
                decode_step_seconds=self.decode_step_seconds,
                kv_tokens_per_dcp_rank=per_rank,
                prefix_cache_queries=self.scheduler.prefix_cache_queries,
                prefix_cache_hits=self.scheduler.prefix_cache_hits,
                kv_blocks_cached=self.pool.num_cached,
                spec_decode_num_drafts=self.spec_num_drafts,
                spec_decode_num_draft_tokens=self.spec_num_draft_tokens,
                spec_decode_num_accepted_tokens=sum(self.spec_accepted_per_pos),
                spec_decode_num_accepted_tokens_per_pos=list(self.spec_accepted_per_pos),
                dcp_timing=self.runner.dcp_timing.report,
            )

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self.scheduler.reset_prefix_cache()

    # --- KV connector (engine/kv_connector.py) -----------------------------------------------
    def attach_kv_connector(self, connector: KVConnectorBase) -> None:
        """KV from and to other instances through `connector` (chosen at start-up), for requests added from now."""
        with self._lock:
            self.kv_connector = self.scheduler.connector = connector

    def _kv_connector_step(self) -> list[RequestOutput]:
        """Between two steps: the connector's engine-thread work, then what it finished; a request whose KV
        could not be loaded ends with an error."""
        self.kv_connector.between_steps()
        outputs = []
        for seq, error in self.scheduler.update_from_connector():
            request = self.requests.pop(seq.request_id, None)
            if request is None:
                self.scheduler.finish(seq, "abort")
                continue
            request.error = f"fetching the prompt's KV failed: {error}"
            self._finish_all(request, "error")
            outputs.append(self.output_processor.output(request))
        return outputs

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            with self._lock:
                self.kv_connector.close()  # kept and reserved KV blocks go back
                self.scheduler.update_from_connector()
        self.structured.shutdown()
        self.executor.shutdown()


def load_tokenizer(config: EngineConfig):
    path = config.model.path
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None  # token ids in, token ids out
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
