"""What rank 0 tells every rank to run in one step, built from the scheduler's batch; and where each
request's rows lie in it (`StepRows`, worked out once per step and read by everything after)."""

from __future__ import annotations

from dataclasses import dataclass

from kvshard.engine.block_tables import BlockTableChanges
from kvshard.engine.scheduler import ScheduledBatch

@dataclass(frozen=True)
class RequestRows:
    """One request's rows in a step."""

    start: int  # its first row in the step's flat batch (it has query_len rows from there)
    prompt_logprobs: range  # prompt positions whose logprobs this step gives (Sequence.pending_prompt_logprobs)
    logits_start: int  # its first row among the logits rank 0 gets: its prompt-logprob rows, then its sampled ones
    num_sampled: int  # rows it samples from: 0, or its last known token's and one per draft

    @property
    def sampled_start(self) -> int:
        """Its first sampled row among the logits rank 0 gets."""
        return self.logits_start + len(self.prompt_logprobs)


@dataclass(frozen=True)
class StepRows:
    """Every request's rows in a step, in the batch's order, and the flat batch they make."""

    requests: list[RequestRows]
    token_ids: list[int]  # the step's tokens, flattened: per request its known tokens, then its drafts
    # rows of the flat batch whose logits rank 0 needs: per request, the prompt positions its prompt
    # logprobs still lack, then the rows it samples from (its last known token, and each of its drafts)
    logit_rows: list[int]

    @classmethod
    def from_batch(cls, batch: ScheduledBatch) -> StepRows:
        requests: list[RequestRows] = []
        token_ids: list[int] = []
        logit_rows: list[int] = []
        for seq, ctx, n, do_sample, drafts in zip(batch.seqs, batch.context_lens, batch.query_lens, batch.sample,
                                                  batch.drafts):
            start = len(token_ids)
            positions = seq.pending_prompt_logprobs(ctx, ctx + n)
            num_sampled = 1 + len(drafts) if do_sample else 0
            requests.append(RequestRows(start, positions, len(logit_rows), num_sampled))
            logit_rows.extend(start + p - ctx for p in positions)
            token_ids.extend(seq.token_ids(ctx, ctx + n - len(drafts)))
            token_ids.extend(drafts)
            # with drafts, every row from the last known token on gives the next token's logits
            logit_rows.extend(range(start + n - num_sampled, start + n))
        return cls(requests, token_ids, logit_rows)


@dataclass(frozen=True)
class StepPlan:
    """Small, plain Python, broadcast once per step: its size grows with the step's tokens and
    requests, not with their contexts (the block tables travel as changes, engine/block_tables.py)."""

    token_ids: list[int]  # new tokens of all requests, flattened
    query_lens: list[int]
    context_lens: list[int]
    # every request's whole block table: only in a plan built by hand (tests, tools), which leaves the
    # ranks' persistent tables alone; the engine's plans carry `tables` instead
    block_tables: list[list[int]] | None
    sample_rows: list[int]  # rows of the flat batch whose logits rank 0 gets back (StepRows.logit_rows)
    draft: bool = False  # run the speculative proposer's module (and its cache) instead of the target
    # what the proposer's module on the ranks needs of this step, in its own typed object (e.g.
    # spec_decode/mtp.py's MtpTargetRows and MtpDraftRows); None for every other method
    spec: object | None = None
    # the block tables' changes since the last plan, and each request's slot in the ranks' tables
    tables: BlockTableChanges | None = None

    @classmethod
    def from_batch(cls, batch: ScheduledBatch, rows: StepRows | None = None, spec: object | None = None,
                   tables: BlockTableChanges | None = None) -> StepPlan:
        """`tables`: the executor's `BlockTableSender.changes(batch.seqs)`; without them (a plan built
        outside the engine) the plan carries the whole tables."""
        rows = rows if rows is not None else StepRows.from_batch(batch)
        return cls(
            token_ids=rows.token_ids,
            query_lens=batch.query_lens,
            context_lens=batch.context_lens,
            block_tables=None if tables is not None else [list(s.block_table) for s in batch.seqs],
            sample_rows=rows.logit_rows,
            spec=spec,
            tables=tables,
        )
