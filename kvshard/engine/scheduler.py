"""Continuous batching under a per-rank KV budget counted in virtual blocks.

Each step: running requests in decode take one token each, oldest first; if a
decode needs a block and none is free, the newest running request is preempted
(its blocks freed, recomputed later). Then partly-prefilled requests and new
ones take chunks of the remaining token budget, so a long prompt never stalls
the decodes. A new request is admitted only while every running request (itself
included) could still grow by block_size tokens, so that an admission does not
simply lead to a preemption a few steps later. A DCP group of N holds `block_size * N` tokens per virtual block,
so the same per-rank memory admits about N times the tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvshard.config import SchedulerConfig
from kvshard.engine.sequence import Sequence, SequenceStatus
from kvshard.kv.block_pool import BlockPool
from kvshard.kv.layout import DCPLayout


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    query_lens: list[int]  # tokens each request computes this step
    context_lens: list[int]  # tokens already in the cache before this step
    sample: list[bool]  # whether the step reaches the request's last token

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, layout: DCPLayout) -> None:
        self.config = config
        self.pool = pool
        self.layout = layout
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the tail is preempted first
        self.num_preemptions = 0

    # --- bookkeeping -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence, whether it stopped, ran out of length or was aborted, and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the block table cover `num_tokens` tokens, if the pool allows."""
        missing = self.layout.num_virtual_blocks(num_tokens) - len(seq.block_table)
        if missing <= 0:
            return True
        if missing > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(missing))
        return True

    # --- one step ----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        chosen: dict[int, tuple[Sequence, int]] = {}

        # 1. Decodes, oldest first; preempt from the newest end when blocks run out.
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1 or budget == 0:
                continue
            while not self._grow(seq, seq.num_tokens):
                victim = next(s for s in reversed(self.running) if s.seq_id not in chosen)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                chosen[seq.seq_id] = (seq, 1)
                budget -= 1

        # 2. Running requests part-way through their prompt: next chunk, no preemption for them.
        for seq in self.running:
            if seq.seq_id in chosen or budget == 0:
                continue
            chunk = min(seq.num_uncomputed_tokens, budget)
            if self._grow(seq, seq.num_computed_tokens + chunk):
                chosen[seq.seq_id] = (seq, chunk)
                budget -= chunk

        # 3. Admit waiting requests while tokens, sequence slots and blocks remain, keeping room for
        #    every running request (the new one too) to grow by block_size tokens: a request admitted
        #    into the last free blocks would be preempted within a few steps and recomputed.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            chunk = min(seq.num_uncomputed_tokens, budget)
            missing = self.layout.num_virtual_blocks(seq.num_computed_tokens + chunk) - len(seq.block_table)
            headroom = self.layout.num_virtual_blocks((len(self.running) + 1) * self.layout.block_size)
            if self.running and self.pool.num_free - missing < headroom:
                break
            if not self._grow(seq, seq.num_computed_tokens + chunk):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen[seq.seq_id] = (seq, chunk)
            budget -= chunk

        if not chosen:
            return None
        # one-token rows first, longest context first: attention pads each run of them to its longest
        # request, and sorted runs split into groups of similar lengths (AttentionMetadata)
        items = sorted(chosen.values(), key=lambda item: (item[1] != 1, -item[0].num_computed_tokens))
        seqs = [seq for seq, _ in items]
        query_lens = [n for _, n in items]
        context_lens = [s.num_computed_tokens for s in seqs]
        sample = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(seqs, query_lens)]
        return ScheduledBatch(seqs, query_lens, context_lens, sample)

    def mark_computed(self, batch: ScheduledBatch) -> None:
        for seq, n in zip(batch.seqs, batch.query_lens):
            seq.num_computed_tokens += n
