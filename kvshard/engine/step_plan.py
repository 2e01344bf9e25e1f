"""What rank 0 tells every rank to run in one step, built from the scheduler's batch."""

from __future__ import annotations

from dataclasses import dataclass

from kvshard.engine.scheduler import ScheduledBatch

# A plan that runs nothing: rank 0 sends it when idle to learn that every rank still answers.
HEARTBEAT = "heartbeat"


@dataclass(frozen=True)
class StepPlan:
    """Small, plain Python, broadcast once per step."""

    token_ids: list[int]  # new tokens of all requests, flattened
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # rows of the flat batch whose logits rank 0 needs

    @classmethod
    def from_batch(cls, batch: ScheduledBatch) -> StepPlan:
        token_ids: list[int] = []
        sample_rows: list[int] = []
        for seq, ctx, n, do_sample in zip(batch.seqs, batch.context_lens, batch.query_lens, batch.sample):
            token_ids.extend(seq.all_token_ids[ctx : ctx + n])
            if do_sample:
                sample_rows.append(len(token_ids) - 1)
        return cls(
            token_ids=token_ids,
            query_lens=batch.query_lens,
            context_lens=batch.context_lens,
            block_tables=[list(s.block_table) for s in batch.seqs],
            sample_rows=sample_rows,
        )
