"""Drafts from a smaller model that shares the target's tokenizer, run on the target's ranks.

Its KV cache is sharded exactly as the target's (same DCP layout) and addressed by the
same block ids: a request's block table serves both models, so the scheduler's
accounting, preemption and rollback need nothing more, and a long context costs the
draft 1/N of its cache per rank too. Each rank holds both caches for every block
(`EngineConfig.kv_bytes_per_slot` counts both).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from kvshard.engine.sampler import sample_with_probs
from kvshard.engine.sequence import Sequence
from kvshard.engine.step_plan import StepPlan
from kvshard.forward_context import forward_context
from kvshard.kv.cache import allocate_kv_cache, kv_cache_spec
from kvshard.models.registry import model_class

if TYPE_CHECKING:
    from kvshard.attention.metadata import AttentionMetadata
    from kvshard.config import EngineConfig
    from kvshard.engine.executor import Executor
    from kvshard.engine.scheduler import ScheduledBatch
    from kvshard.engine.step_plan import StepRows
    from kvshard.parallel import ParallelState


class DraftModelProposer:
    """Rank 0's side (a `Proposer`, proposer.py): drafts from the draft model once their blocks are held."""

    def __init__(self, executor: Executor, default_generator: torch.Generator) -> None:
        self.executor = executor
        self.default_generator = default_generator

    def wanted_drafts(self, seq: Sequence, limit: int) -> int:
        return limit

    def draft(self, batch: ScheduledBatch) -> dict[int, torch.Tensor | None]:
        chosen = [i for i, count in enumerate(batch.num_drafts) if count]
        drafts, probs = self.propose([batch.seqs[i] for i in chosen], [batch.num_drafts[i] for i in chosen])
        for i, request_drafts in zip(chosen, drafts):
            batch.drafts[i] = request_drafts
        return {batch.seqs[i].seq_id: p for i, p in zip(chosen, probs)}

    def target_step(self, batch: ScheduledBatch, rows: StepRows) -> None:
        return None

    def propose(self, seqs: list[Sequence], counts: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """`counts[i]` drafts for each request, whose block table already covers them; for sampled
        requests also the draft distributions [counts[i], V] they were drawn from (None if greedy).

        Pass 0 feeds the draft model every token it has not read yet (the whole prompt after a
        prefill or a preemption, else the tokens accepted since); pass j > 0 feeds draft j.
        """
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(max(counts, default=0)):
            active = [i for i, count in enumerate(counts) if count > step]
            token_ids: list[int] = []
            query_lens, context_lens, sample_rows = [], [], []
            for i in active:
                seq = seqs[i]
                if step == 0:
                    new = seq.token_ids(seq.draft_num_computed_tokens, seq.num_tokens)
                    context_lens.append(seq.draft_num_computed_tokens)
                else:
                    new = [drafts[i][-1]]
                    context_lens.append(seq.num_tokens + step - 1)
                token_ids.extend(new)
                query_lens.append(len(new))
                sample_rows.append(len(token_ids) - 1)
            plan = StepPlan(token_ids, query_lens, context_lens, None, sample_rows, draft=True,
                            tables=self.executor.block_tables.changes([seqs[i] for i in active]))
            logits = self.executor.execute(plan).cpu()  # [len(active), V]
            for i, (token, row_probs) in zip(active, sample_with_probs(logits, [seqs[i] for i in active],
                                                                         self.default_generator,
                                                                         [drafts[i] for i in active])):
                drafts[i].append(token)
                if row_probs is not None:
                    probs[i].append(row_probs)
                seqs[i].draft_num_computed_tokens = seqs[i].num_tokens + step
        return drafts, [torch.stack(p) if p else None for p in probs]


class DraftModelModule:
    """Every rank's side (a `DraftModule`): the draft model's shard and its cache."""

    def __init__(self, config: EngineConfig, parallel: ParallelState, device: torch.device,
                 metadata: Callable[..., AttentionMetadata], load: Callable) -> None:
        draft = config.speculative.draft_model_config
        cls = model_class(draft.architecture)
        self.model = load(lambda: cls(draft.hf_config, draft.dtype, parallel), draft)
        self.kv_caches = allocate_kv_cache(kv_cache_spec(draft, config.parallel.attention_tp_size),
                                           config.num_kv_blocks, config.cache.block_size, draft.dtype, device)

    def run_draft(self, plan: StepPlan, input_ids: torch.Tensor, meta: AttentionMetadata,
                  rows: torch.Tensor) -> torch.Tensor:
        with forward_context(meta, self.kv_caches):
            states = self.model(input_ids, meta.positions)
        return self.model.compute_logits(states[rows])

    def after_target(self, plan: StepPlan, states: torch.Tensor) -> None:
        pass  # the draft model reads the tokens, not the target's states
