"""Drafts from a smaller model that shares the target's tokenizer, run on the target's ranks.

Its KV cache is sharded exactly as the target's (same DCP layout) and addressed by the
same block ids: a request's block table serves both models, so the scheduler's
accounting, preemption and rollback need nothing more, and a long context costs the
draft 1/N of its cache per rank too. Each rank holds both caches for every block
(`EngineConfig.kv_bytes_per_slot` counts both).
"""

from __future__ import annotations

import torch

from kvshard.engine.executor import Executor
from kvshard.engine.sampler import sample_with_probs
from kvshard.engine.sequence import Sequence
from kvshard.engine.step_plan import StepPlan


class DraftModelProposer:
    def __init__(self, executor: Executor, default_generator: torch.Generator) -> None:
        self.executor = executor
        self.default_generator = default_generator

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
                    new = seq.all_token_ids[seq.draft_num_computed_tokens:]
                    context_lens.append(seq.draft_num_computed_tokens)
                else:
                    new = [drafts[i][-1]]
                    context_lens.append(seq.num_tokens + step - 1)
                token_ids.extend(new)
                query_lens.append(len(new))
                sample_rows.append(len(token_ids) - 1)
            plan = StepPlan(token_ids, query_lens, context_lens, [list(seqs[i].block_table) for i in active],
                            sample_rows, draft=True)
            logits = self.executor.execute(plan).cpu()  # [len(active), V]
            for i, (token, row_probs) in zip(active, sample_with_probs(logits, [seqs[i] for i in active],
                                                                         self.default_generator)):
                drafts[i].append(token)
                if row_probs is not None:
                    probs[i].append(row_probs)
                seqs[i].draft_num_computed_tokens = seqs[i].num_tokens + step
        return drafts, [torch.stack(p) if p else None for p in probs]
