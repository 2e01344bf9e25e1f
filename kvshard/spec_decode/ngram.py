"""Prompt-lookup drafting: continue the request the way its own tokens continued before."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvshard.engine.scheduler import ScheduledBatch
    from kvshard.engine.sequence import Sequence
    from kvshard.engine.step_plan import StepRows


class NgramProposer:
    """Drafts the tokens that followed the latest earlier occurrence of the request's last n tokens,
    for the longest n in [min_n, max_n] that occurs; no model, no state between steps. A `Proposer`
    (proposer.py): its drafts are known before scheduling, so it asks room for exactly as many."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._proposed: dict[int, list[int]] = {}  # by seq_id: this step's proposals, until scheduled

    def wanted_drafts(self, seq: Sequence, limit: int) -> int:
        drafts = self.propose(seq.all_token_ids, limit)
        if drafts and seq.grammar is not None:  # only the drafts the output's constraint allows
            drafts = drafts[: seq.grammar.validate_tokens(drafts)]
        self._proposed[seq.seq_id] = drafts
        return len(drafts)

    def draft(self, batch: ScheduledBatch) -> dict[int, torch.Tensor | None]:
        """The proposals, cut to the slots the scheduler granted."""
        proposed, self._proposed = self._proposed, {}
        for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_drafts)):
            if count:
                batch.drafts[i] = proposed[seq.seq_id][:count]
        return {}

    def target_step(self, batch: ScheduledBatch, rows: StepRows) -> None:
        return None

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens (fewer when the match lies near the end, none without a match)."""
        if max_drafts <= 0:
            return []
        total = len(token_ids)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = token_ids[total - n:]
            last = suffix[-1]
            # an earlier occurrence ends at `end` < total - 1: the latest one followed by max_drafts tokens,
            # else the one followed by the most (in a repeating run the latest occurrences overlap the
            # suffix and leave few tokens to propose)
            full = total - 1 - max_drafts
            ends = itertools.chain(range(full, n - 2, -1), range(max(full, n - 2) + 1, total - 1))
            for end in ends:
                if token_ids[end] == last and token_ids[end - n + 1 : end + 1] == suffix:
                    return token_ids[end + 1 : end + 1 + max_drafts]
        return []
