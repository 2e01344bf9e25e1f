"""The engine on rank 0: requests in, one scheduled step at a time, outputs out.

A step: the scheduler picks tokens under the KV and token budgets -> the
executor runs the step's plan on every rank (DCP attention inside) -> rank 0
samples -> the output processor appends the tokens, detokenizes and applies the
stop conditions -> sequences that stop release their blocks. With speculative
decoding, drafts are proposed for the decoding requests before the scheduler
runs, and verified after the step (`sampler.verify_drafts`).
"""

from __future__ import annotations

import os
import threading
import time

import torch

from kvshard.config import EngineConfig
from kvshard.engine.executor import EngineDeadError, Executor
from kvshard.engine.output_processor import OutputProcessor, Request
from kvshard.engine.sampler import sample, top_logprobs, verify_drafts
from kvshard.engine.scheduler import ScheduledBatch, Scheduler
from kvshard.engine.sequence import Sequence
from kvshard.engine.step_plan import StepPlan
from kvshard.engine.stats import EngineStats
from kvshard.kv.block_pool import BlockPool
from kvshard.outputs import RequestOutput
from kvshard.sampling_params import SamplingParams, StructuredOutputsParams
from kvshard.spec_decode.draft_model import DraftModelProposer
from kvshard.spec_decode.mtp import MtpProposer
from kvshard.spec_decode.ngram import NgramProposer
from kvshard.structured.manager import StructuredOutputManager, result, timed_out

__all__ = ["EngineDeadError", "LLMEngine"]


class LLMEngine:
    """Scheduler + executor + output processing: requests in, one scheduled step at a time, outputs out."""

    def __init__(self, config: EngineConfig, master: tuple[str, int] | None = None) -> None:
        """Start every rank. `master` (host, port) is given when a launcher (torchrun) started the other ranks."""
        self.config = config
        self.executor = Executor(config, master)
        self.tokenizer = load_tokenizer(config)
        self.layout = config.dcp_layout
        self.pool = BlockPool(config.num_kv_blocks)
        self.scheduler = Scheduler(config.scheduler, self.pool, self.layout, config.cache.enable_prefix_caching,
                                   fixed_chunks=config.batch_invariant)
        self.output_processor = OutputProcessor(self.tokenizer, config.model.hf_config, config.scheduler.max_model_len)
        self.requests: dict[str, Request] = {}
        # structured outputs: grammars compile off this thread; requests waiting for theirs, by id
        self.structured = StructuredOutputManager(self.tokenizer, config.model.hf_config.vocab_size,
                                                  self.output_processor.eos_token_ids)
        self._compiling: dict[str, tuple] = {}  # request id -> (future, when submitted)
        self.default_generator = torch.Generator().manual_seed(config.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps = 0
        self.speculative = config.speculative
        self.proposer: NgramProposer | None = None  # drafts from the request's tokens, before scheduling
        self.draft_model: DraftModelProposer | None = None  # drafts from a model, once their blocks are held
        self.mtp: MtpProposer | None = None  # drafts from the checkpoint's MTP module, likewise
        if self.speculative is not None and self.speculative.method == "ngram":
            self.proposer = NgramProposer(self.speculative.prompt_lookup_min, self.speculative.prompt_lookup_max)
        elif self.speculative is not None and self.speculative.method == "mtp":
            self.mtp = MtpProposer(self.executor, self.default_generator)
        elif self.speculative is not None:
            self.draft_model = DraftModelProposer(self.executor, self.default_generator)
        # speculative decoding counters, as EngineStats names them
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_accepted_per_pos = [0] * (self.speculative.num_speculative_tokens if self.speculative else 0)
        self._lock = threading.RLock()  # add/abort may come from other threads than step
        self.kv_connector = None  # disagg.connector.KVConnector when this instance prefills or decodes remotely

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
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.config.model.hf_config.vocab_size
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
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
        if params.structured_outputs is not None and (params.kv_transfer_params or {}).get("do_remote_prefill"):
            raise ValueError("structured_outputs cannot be combined with kv_transfer_params.do_remote_prefill: "
                             "a request whose prompt's KV comes from a producer runs unconstrained")
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
                if self.kv_connector is not None:
                    self.kv_connector.forget(seq)  # a request whose KV is on its way: back in the queue to end
                self.scheduler.finish(seq, reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or (self.kv_connector is not None and self.kv_connector.has_pending())

    # --- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return an output for every request that advanced or finished."""
        with self._lock:
            failed = self.kv_connector.before_schedule() if self.kv_connector is not None else []
            if self._compiling:
                failed += self._start_grammars()
            if self.speculative is not None:
                self._propose()
            batch = self.scheduler.schedule()
            if batch is None:
                if self._compiling:  # nothing else to do: wait a little for a grammar rather than spin
                    self.structured.wait_any([future for future, _ in self._compiling.values()], 0.01)
                self.executor.check_alive()
                return failed
            draft_probs = None
            if self.draft_model is not None:
                draft_probs = self._run_draft_model(batch)
            elif self.mtp is not None:
                draft_probs = self.mtp.propose(batch)
            plan = StepPlan.from_batch(batch)
            logits = self.executor.execute(self.mtp.target_plan(batch, plan) if self.mtp is not None else plan)
            self.steps += 1
            logits = self._take_prompt_logprobs(batch, logits)
            self.scheduler.mark_computed(batch)
            return failed + self._process_samples(batch, logits, draft_probs)

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

    def _propose(self) -> None:
        """Drafts for every decoding request, never past max_tokens or max_model_len (the token after
        the drafts must still fit)."""
        k = self.speculative.num_speculative_tokens
        for seq in self.scheduler.running:
            if seq.num_uncomputed_tokens != 1:
                continue
            room = self.config.scheduler.max_model_len - seq.num_tokens - 1
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
            if self.proposer is not None:
                seq.spec_token_ids = self.proposer.propose(seq.all_token_ids, min(k, room))
                if seq.grammar is not None:  # only the drafts its output constraint allows
                    seq.spec_token_ids = seq.spec_token_ids[: seq.grammar.validate_tokens(seq.spec_token_ids)]
            else:  # a model fills in the drafts the scheduler found room for (`_run_draft_model`, MtpProposer)
                drafts = max(0, min(k, room)) if self.mtp is None or self.mtp.can_draft(seq) else 0
                seq.spec_token_ids = [-1] * drafts

    def _run_draft_model(self, batch: ScheduledBatch) -> dict[int, torch.Tensor | None]:
        """Replace the scheduled placeholder drafts by the draft model's; their distributions by seq_id."""
        chosen = [i for i, drafts in enumerate(batch.drafts) if drafts]
        seqs = [batch.seqs[i] for i in chosen]
        drafts, probs = self.draft_model.propose(seqs, [len(batch.drafts[i]) for i in chosen])
        for i, request_drafts in zip(chosen, drafts):
            batch.drafts[i] = request_drafts
        return {batch.seqs[i].seq_id: p for i, p in zip(chosen, probs)}

    def _take_prompt_logprobs(self, batch: ScheduledBatch, logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt logprobs that this step's prompt rows give (each request's rows come first,
        in position order, as StepPlan.from_batch lays them out); returns the logits of the rows to sample."""
        if all(seq.prompt_logprobs is None for seq in batch.seqs):
            return logits
        logits = logits.cpu()  # [prompt rows + sampled rows, V]
        sampled_rows: list[int] = []
        row = 0
        for seq, ctx, n, do_sample, drafts in zip(batch.seqs, batch.context_lens, batch.query_lens, batch.sample,
                                                  batch.drafts):
            positions = seq.pending_prompt_logprobs(ctx, ctx + n)
            if positions:
                # the logits at position p predict prompt token p + 1
                next_tokens = seq.prompt_token_ids[positions.start + 1 : positions.stop + 1]
                counts = [seq.params.prompt_logprobs] * len(positions)
                seq.prompt_logprobs.extend(top_logprobs(logits[row : row + len(positions)], next_tokens, counts))
                row += len(positions)
            if do_sample:  # its last known token's row, then one per draft
                sampled_rows.extend(range(row, row + 1 + len(drafts)))
                row += 1 + len(drafts)
        return logits[sampled_rows]  # [sampled rows, V]

    def _process_samples(self, batch: ScheduledBatch, logits: torch.Tensor | None,
                         draft_probs: dict[int, torch.Tensor | None] | None = None) -> list[RequestOutput]:
        """`draft_probs`: by seq_id, the distributions a draft model drew the drafts from."""
        sampled = [(s, d) for s, d, do in zip(batch.seqs, batch.drafts, batch.sample) if do]
        if not sampled:
            return []
        logits = logits.cpu()  # sampling and per-request generators live on the host
        seqs = [seq for seq, _ in sampled]
        first_rows: list[int] = []  # each request's first logits row: it has 1 + len(drafts) rows
        row = 0
        for _, drafts in sampled:
            first_rows.append(row)
            row += 1 + len(drafts)
        outcomes: list[list[int] | Exception] = [[] for _ in sampled]
        plain = [i for i, (_, drafts) in enumerate(sampled) if not drafts]
        if plain:
            tokens = sample(logits[[first_rows[i] for i in plain]], [seqs[i] for i in plain], self.default_generator)
            for i, outcome in zip(plain, tokens):
                outcomes[i] = outcome if isinstance(outcome, Exception) else [outcome]
        speculating = [i for i, (_, drafts) in enumerate(sampled) if drafts]
        if speculating:
            rows = [r for i in speculating for r in range(first_rows[i], first_rows[i] + 1 + len(sampled[i][1]))]
            verified = verify_drafts(logits[rows], [seqs[i] for i in speculating],
                                     [sampled[i][1] for i in speculating], self.default_generator,
                                     [draft_probs.get(seqs[i].seq_id) for i in speculating] if draft_probs else None)
            for i, outcome in zip(speculating, verified):
                outcomes[i] = outcome
                if not isinstance(outcome, Exception):
                    self._count_drafts(len(sampled[i][1]), len(outcome) - 1)
        touched: dict[str, Request] = {}
        for i, ((seq, drafts), outcome) in enumerate(zip(sampled, outcomes)):
            request = touched[seq.request_id] = self.requests[seq.request_id]
            if request.error is not None:
                continue  # a sibling sequence of this step already failed the request
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                for offset, token in enumerate(outcome):
                    self._append(seq, token, logits[first_rows[i] + offset])
                    if seq.is_finished:
                        break
                if drafts and not seq.is_finished:
                    self.scheduler.accept_drafts(seq, len(outcome) - 1)
            except Exception as error:  # this request's sampling or post-processing failed: it alone ends
                request.error = f"generating this request failed: {error}"
                self._finish_all(request, "error")
        outputs = []
        for request in touched.values():
            output = self.output_processor.output(request)
            if output.finished:
                del self.requests[request.request_id]
            outputs.append(output)
        return outputs

    def _append(self, seq: Sequence, token: int, logits: torch.Tensor) -> None:
        """logits [V] of the row that gave `token`."""
        if seq.params.logprobs is not None:
            seq.output_logprobs.append(top_logprobs(logits.unsqueeze(0), [token], [seq.params.logprobs])[0])
        self.generation_tokens_total += 1
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            raise ValueError(f"token {token} breaks the output's structured_outputs constraint (min_tokens, "
                             "bad_words or logit_bias left the constraint no token to choose)")
        reason = self.output_processor.append_token(seq, token)
        if reason is None and seq.grammar is not None and seq.grammar.is_terminated():
            reason = "stop"  # the constraint is complete and took its stop token
        if reason is not None:
            if self.kv_connector is not None:
                self.kv_connector.on_finish(seq)  # a producer keeps the KV for its consumer
            self.scheduler.finish(seq, reason)

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

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.close()  # held and reserved KV blocks go back
        self.structured.shutdown()
        self.executor.shutdown()


def load_tokenizer(config: EngineConfig):
    path = config.model.path
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None  # token ids in, token ids out
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
