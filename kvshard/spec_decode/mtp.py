"""Drafts from the checkpoint's own multi-token-prediction (MTP) module (DeepSeek-V3, Kimi K2).

The MTP module reads the target's last-layer state at position p and the token at p + 1,
and predicts the token at p + 2; its one decoder layer has its own cache, sharded as the
target's (same DCP layout, same block ids), whose entry at p holds that pair. So each
target step also writes the entries of every row whose next token it knows (prompt rows,
and each row followed by a draft: valid as far as the drafts are accepted), and the ranks
keep the states of the rows the next step's drafts start from (each sampled request's last
known token and drafts: one of them is the last accepted). Nothing but row indices crosses
from rank 0: the states are replicated over TP, and stay on the ranks.

Drafting a request whose tokens end at position m (m = num_tokens - 1): pass 0 writes the
entry at m - 1 (kept state at m - 1, token m) and its output gives draft 1; pass j > 0
feeds draft j at m - 1 + j with pass j - 1's output state (the module applied again to its
own state, as vLLM does with one MTP layer) and gives draft j + 1. Entries written by
passes j > 0 are rewritten by the verification step. An entry depends on the token after
it, which a block's hash does not name, so prefix caching is off with MTP.
"""

from __future__ import annotations

import dataclasses

import torch

from kvshard.engine.executor import Executor
from kvshard.engine.sampler import sample_with_probs
from kvshard.engine.scheduler import ScheduledBatch
from kvshard.engine.sequence import Sequence
from kvshard.engine.step_plan import StepPlan


@dataclasses.dataclass(frozen=True)
class _Kept:
    row: int  # the request's first kept row on the ranks
    position: int  # the position of that row (its last known token in that step)
    num_rows: int  # 1 + the drafts it verified


class MtpProposer:
    def __init__(self, executor: Executor, default_generator: torch.Generator) -> None:
        self.executor = executor
        self.default_generator = default_generator
        self.kept: dict[int, _Kept] = {}  # by seq_id: the rows the last target step kept

    def _kept_row(self, seq: Sequence) -> int | None:
        """The kept row of `seq`'s position num_tokens - 2 (its last accepted row), if the ranks hold it."""
        kept = self.kept.get(seq.seq_id)
        if kept is None:
            return None
        offset = seq.num_tokens - 2 - kept.position
        return kept.row + offset if 0 <= offset < kept.num_rows else None

    def can_draft(self, seq: Sequence) -> bool:
        return self._kept_row(seq) is not None

    def target_plan(self, batch: ScheduledBatch, plan: StepPlan) -> StepPlan:
        """`plan` (the target step of `batch`) with the MTP rows: each row's next token, the rows to keep."""
        next_token_ids: list[int] = []
        keep_rows: list[int] = []
        kept: dict[int, _Kept] = {}
        for seq, ctx, n, do_sample, drafts in zip(batch.seqs, batch.context_lens, batch.query_lens, batch.sample,
                                                  batch.drafts):
            tokens = seq.all_token_ids[ctx : ctx + n - len(drafts)] + drafts
            # a prompt chunk's last row is followed by the next chunk's first token
            next_token_ids += tokens[1:] + [seq.all_token_ids[ctx + n] if ctx + n < seq.num_tokens else -1]
            if do_sample:  # as StepPlan.from_batch lays out the rows rank 0 samples
                kept[seq.seq_id] = _Kept(len(keep_rows), ctx + n - 1 - len(drafts), 1 + len(drafts))
                keep_rows += range(len(next_token_ids) - 1 - len(drafts), len(next_token_ids))
        self.kept = kept
        return dataclasses.replace(plan, next_token_ids=next_token_ids, keep_rows=keep_rows)

    def propose(self, batch: ScheduledBatch) -> dict[int, torch.Tensor | None]:
        """Replace the scheduled placeholder drafts by the MTP module's (in `batch.drafts`); returns, by
        seq_id, the distributions [drafts, V] sampled drafts were drawn from (None if greedy). Every
        decoding request with kept states takes pass 0, with drafts or not, so its cache stays whole."""
        active: list[int] = []  # indices into the batch
        rows: list[int] = []  # their rows among the states the ranks hold
        for i, seq in enumerate(batch.seqs):
            row = self._kept_row(seq)
            if row is not None and batch.context_lens[i] == seq.num_tokens - 1:
                active.append(i)
                rows.append(row)
        missing = [i for i, drafts in enumerate(batch.drafts) if drafts and i not in active]
        assert not missing, "drafts were scheduled for requests whose MTP states are not kept"
        drafts: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        step = 0
        while active:
            seqs = [batch.seqs[i] for i in active]
            wanted = [j for j, i in enumerate(active) if len(batch.drafts[i]) > step]
            token_ids = [seq.all_token_ids[-1] if step == 0 else drafts[i][-1] for i, seq in zip(active, seqs)]
            plan = StepPlan(token_ids, [1] * len(active), [seq.num_tokens - 2 + step for seq in seqs],
                            [list(seq.block_table) for seq in seqs], wanted, draft=True, hidden_rows=rows)
            logits = self.executor.execute(plan).cpu()  # [len(wanted), V]
            for j, (token, row_probs) in zip(wanted, sample_with_probs(logits, [seqs[j] for j in wanted],
                                                                         self.default_generator)):
                drafts[active[j]].append(token)
                if row_probs is not None:
                    probs[active[j]].append(row_probs)
            # the next pass: the requests that want another draft, from their rows of this pass's output
            rows = [j for j in wanted if len(batch.drafts[active[j]]) > step + 1]
            active = [active[j] for j in rows]
            step += 1
        for i, request_drafts in drafts.items():
            if batch.drafts[i]:
                batch.drafts[i] = request_drafts
        return {batch.seqs[i].seq_id: torch.stack(p) if p else None for i, p in probs.items()}
