"""What rank 0 tells every rank to run in one step, built from the scheduler's batch."""

from __future__ import annotations

from dataclasses import dataclass

from kvshard.engine.scheduler import ScheduledBatch

@dataclass(frozen=True)
class StepPlan:
    """Small, plain Python, broadcast once per step."""

    token_ids: list[int]  # new tokens of all requests, flattened
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    # rows of the flat batch whose logits rank 0 needs: per request, the prompt positions its prompt
    # logprobs still lack (Sequence.pending_prompt_logprobs), then the rows it samples from (its last
    # known token, and each of its drafts when it verifies some)
    sample_rows: list[int]
    draft: bool = False  # run the speculative draft model or MTP module (and its cache) instead of the target
    # MTP, target steps: the token after each row in its request (a draft where one follows), -1 where the
    # step samples it: the MTP module writes the cache entry of every row with a next token; and the rows
    # whose last-layer states the ranks keep for the next draft pass (kvshard/spec_decode/mtp.py)
    next_token_ids: list[int] | None = None
    keep_rows: list[int] | None = None
    # MTP, draft steps: each request's row among the states the ranks kept last
    hidden_rows: list[int] | None = None

    @classmethod
    def from_batch(cls, batch: ScheduledBatch) -> StepPlan:
        token_ids: list[int] = []
        sample_rows: list[int] = []
        for seq, ctx, n, do_sample, drafts in zip(batch.seqs, batch.context_lens, batch.query_lens, batch.sample,
                                                  batch.drafts):
            sample_rows.extend(len(token_ids) + p - ctx for p in seq.pending_prompt_logprobs(ctx, ctx + n))
            token_ids.extend(seq.all_token_ids[ctx : ctx + n - len(drafts)])
            token_ids.extend(drafts)
            if do_sample:  # with drafts, every row from the last known token on gives the next token's logits
                sample_rows.extend(range(len(token_ids) - 1 - len(drafts), len(token_ids)))
        return cls(
            token_ids=token_ids,
            query_lens=batch.query_lens,
            context_lens=batch.context_lens,
            block_tables=[list(s.block_table) for s in batch.seqs],
            sample_rows=sample_rows,
        )
