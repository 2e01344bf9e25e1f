"""Continuous batching under a per-rank KV budget counted in virtual blocks.

Each step: running requests in decode take one token each, oldest first; if a
decode needs a block and none is free, the newest running request is preempted
(its blocks freed, recomputed later). Then partly-prefilled requests and new
ones take chunks of the remaining token budget, so a long prompt never stalls
the decodes. A new request is admitted only while every running request (itself
included) could still grow by block_size tokens, so that an admission does not
simply lead to a preemption a few steps later. A DCP group of N holds `block_size * N` tokens per virtual block,
so the same per-rank memory admits about N times the tokens.

With prefix caching, a request admitted from the queue first takes the longest
cached prefix of its tokens in whole virtual blocks (never its last token: the
model must compute at least one to give logits, nor a prompt position whose
prompt logprobs the request still needs) and prefills only the rest, the way a
chunked prefill continues against cached context. Waiting requests are taken in
arrival order (`fcfs`), or with `lpm` the longest cached prefix first, ties in
arrival order, so that a session's next turn is admitted while its blocks are
still cached. Each virtual block is
named once its K/V are all computed, so a block is shared only when it is full
and no request writes into it again.

With speculative decoding a decoding request asks room for drafts (`Sequence.num_spec_tokens`,
set by its proposer): once every decode has its token, the drafts take what is left of the
token budget and of the free blocks (a draft never preempts anyone; `ScheduledBatch.num_drafts`),
the proposer fills them in (`ScheduledBatch.drafts`, kvshard/spec_decode/proposer.py), and the
request computes its last token and the drafts in one step. `accept_drafts` then keeps the K/V of the accepted
drafts and gives back the blocks only rejected drafts used.

With a KV connector (engine/kv_connector.py) a request whose prompt's KV comes from
another instance waits in `remote` until a sequence slot and blocks for its whole
prompt are free; the blocks are then reserved and the request is `loading` (in no
batch) until the connector says its KV is there, when it joins the running requests
with those tokens computed. A finished request whose KV the connector sends keeps
its blocks (`saving`) until the connector says they may go back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvshard.config import LPM, SchedulerConfig
from kvshard.engine.kv_connector import KVConnectorBase
from kvshard.engine.sequence import Sequence, SequenceStatus
from kvshard.kv.block_pool import BlockPool
from kvshard.kv.layout import DCPLayout
from kvshard.kv.prefix_cache import extend_block_hashes


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    query_lens: list[int]  # tokens each request computes this step
    context_lens: list[int]  # tokens already in the cache before this step
    sample: list[bool]  # whether the step reaches the request's last token
    num_drafts: list[int]  # draft slots each request verifies this step (after its last token)
    # the drafts in those slots: written by the proposer once the batch is scheduled (Proposer.draft)
    drafts: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.drafts:
            self.drafts = [[] for _ in self.seqs]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens the step computes that are not a decode's: prompt chunks and context recomputed after a
        preemption. A request that reaches its last known token counts that one, with its drafts, as its decode."""
        return sum(n - d - int(s) for n, d, s in zip(self.query_lens, self.num_drafts, self.sample))


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, layout: DCPLayout,
                 enable_prefix_caching: bool = True, fixed_chunks: bool = False) -> None:
        self.config = config
        self.pool = pool
        self.layout = layout
        self.enable_prefix_caching = enable_prefix_caching
        # batch-invariant mode: prompts are cut at multiples of one chunk size, never at what other
        # requests left of the budget, so a prompt's chunks do not depend on the batch. The size leaves
        # room for a full batch of decodes, so a chunk always fits a step sooner or later.
        self.fixed_chunk_size = max(1, config.max_num_batched_tokens - config.max_num_seqs) if fixed_chunks else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the tail is preempted first
        self.num_preemptions = 0
        # tokens of admitted requests looked up in the prefix cache (each admission, re-admissions after
        # preemption too), and of those found there
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # KV connector (engine/kv_connector.py); the requests it has in hand, by seq_id
        self.connector: KVConnectorBase | None = None
        self.remote: deque[tuple[Sequence, int]] = deque()  # waiting to load (seq, external tokens)
        self.loading: dict[int, tuple[Sequence, int]] = {}  # blocks reserved, KV on its way
        self.abandoned: dict[int, list[int]] = {}  # loads whose request ended: blocks freed once the load is over
        self.saving: dict[int, list[int]] = {}  # finished requests whose blocks the connector sends

    # --- bookkeeping -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        external = self.connector.get_num_external_tokens(seq) if self.connector is not None else 0
        if external > 0:
            if not external < seq.num_tokens:
                raise ValueError(f"a connector may provide at most {seq.num_tokens - 1} of this prompt's "
                                 f"{seq.num_tokens} tokens, not {external}")
            self.remote.append((seq, external))
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Work for the next step. A load that has no room yet waits for a running request or a load to end
        (the connector's `has_pending` says when one does)."""
        return bool(self.waiting or self.running) or any(self._can_load(seq) for seq, _ in self.remote)

    def _can_load(self, seq: Sequence) -> bool:
        return (len(self.running) + len(self.loading) < self.config.max_num_seqs
                and self.layout.num_virtual_blocks(seq.num_tokens) <= self.pool.num_free)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence, whether it stopped, ran out of length or was aborted, and free its blocks (unless
        the connector keeps them to send them, or is still loading into them)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            if seq.seq_id in self.loading:
                del self.loading[seq.seq_id]
                self.abandoned[seq.seq_id] = seq.block_table
                seq.block_table = []
                self.connector.abort_load(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            else:
                self.remote = deque(item for item in self.remote if item[0] is not seq)
        if (reason in ("stop", "length") and self.connector is not None and seq.block_table
                and self.connector.request_finished(seq)):
            self.saving[seq.seq_id] = seq.block_table
            seq.block_table = []
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def update_from_connector(self) -> list[tuple[Sequence, str]]:
        """Between two steps: loads that are over join the running requests (or are returned with why
        they failed, still WAITING and in no queue, for the engine to end); saves that are over give
        their blocks back."""
        if self.connector is None:
            return []
        loaded, saved = self.connector.get_finished()
        failed = []
        for seq_id, error in loaded.items():
            if seq_id in self.abandoned:
                self.pool.free(self.abandoned.pop(seq_id))
                continue
            seq, external = self.loading.pop(seq_id)
            if error is not None:
                self.pool.free(seq.block_table)
                seq.block_table = []
                failed.append((seq, error))
                continue
            seq.num_computed_tokens = external
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        for seq_id in saved:
            self.pool.free(self.saving.pop(seq_id))
        return failed

    def _start_loads(self) -> None:
        """Reserve blocks for the whole prompt of each remote request that has a sequence slot and blocks,
        in arrival order (one that does not fit lets later ones try), and let the connector load them. A request
        whose output constraint still compiles waits here, holding nothing: a loaded request joins the running
        batch, whose next step samples its first token, and that token must be under the constraint."""
        for item in list(self.remote):
            seq, external = item
            if seq.waits_for_grammar or not self._can_load(seq):
                continue
            self.remote.remove(item)
            seq.block_table = self.pool.allocate(self.layout.num_virtual_blocks(seq.num_tokens))
            self.loading[seq.seq_id] = (seq, external)
            self.connector.start_load(seq, seq.block_table, external)

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_named_blocks = 0
        seq.num_spec_tokens = 0
        seq.draft_num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; running requests keep their blocks, now private to them."""
        self.pool.reset_prefix_cache()

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of `seq`, at most its tokens but the last."""
        if not self.enable_prefix_caching:
            return []
        per_block = self.layout.tokens_per_virtual_block
        _extend_hashes(seq, per_block)
        reusable = seq.num_tokens - 1
        if pending := seq.pending_prompt_logprobs(0, reusable):
            reusable = pending.start  # a position whose prompt logprobs are still missing must be computed
        return self.pool.lookup(seq.block_hashes[: reusable // per_block])

    def _longest_prefix_first(self) -> None:
        """Order the waiting requests by the length of their cached prefix, longest first (a stable
        sort: ties keep their order, arrival or, for a preempted request, its place at the front)."""
        cached = {seq.seq_id: len(self._cached_prefix(seq)) for seq in self.waiting}
        self.waiting = deque(sorted(self.waiting, key=lambda seq: -cached[seq.seq_id]))

    def _name_full_blocks(self, seq: Sequence) -> None:
        """Name the blocks whose K/V are now complete, so that later requests can find them."""
        per_block = self.layout.tokens_per_virtual_block
        full = seq.num_computed_tokens // per_block
        if full <= seq.num_named_blocks:
            return
        _extend_hashes(seq, per_block)
        for index in range(seq.num_named_blocks, full):
            self.pool.name(seq.block_table[index], seq.block_hashes[index])
        seq.num_named_blocks = full

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _chunk(self, uncomputed: int, budget: int) -> int:
        """Prompt tokens to compute now; 0 when fixed chunks do not fit what is left of the budget."""
        if self.fixed_chunk_size is None:
            return min(uncomputed, budget)
        chunk = min(uncomputed, self.fixed_chunk_size)
        return chunk if chunk <= budget else 0

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

        # 0. Loads that have room start (they take no token budget: the connector fills their blocks).
        if self.remote:
            self._start_loads()

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

        # 1b. Drafts, once every decode has its token: within the budget and the free blocks.
        drafts: dict[int, int] = {}
        for seq, _ in list(chosen.values()):
            if not seq.num_spec_tokens or budget == 0:
                continue
            room = (len(seq.block_table) + self.pool.num_free) * self.layout.tokens_per_virtual_block - seq.num_tokens
            wanted = max(0, min(seq.num_spec_tokens, budget, room))
            if wanted and self._grow(seq, seq.num_tokens + wanted):
                drafts[seq.seq_id] = wanted
                chosen[seq.seq_id] = (seq, 1 + wanted)
                budget -= wanted

        # 2. Running requests part-way through their prompt: next chunk, no preemption for them.
        for seq in self.running:
            if seq.seq_id in chosen or budget == 0:
                continue
            chunk = self._chunk(seq.num_uncomputed_tokens, budget)
            if chunk and self._grow(seq, seq.num_computed_tokens + chunk):
                chosen[seq.seq_id] = (seq, chunk)
                budget -= chunk

        # 3. Admit waiting requests while tokens, sequence slots and blocks remain, keeping room for
        #    every running request (the new one too) to grow by block_size tokens: a request admitted
        #    into the last free blocks would be preempted within a few steps and recomputed. Cached
        #    blocks that are free cost free blocks too.
        room = budget > 0 and len(self.running) < self.config.max_num_seqs  # else nobody is admitted: no lookups
        if room and self.config.policy == LPM and self.enable_prefix_caching and len(self.waiting) > 1:
            self._longest_prefix_first()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            # holds no block: new, or preempted and released; one whose grammar compiles still is passed over
            seq = next((s for s in self.waiting if not s.waits_for_grammar), None)
            if seq is None:
                break
            cached = self._cached_prefix(seq)
            hit = len(cached) * self.layout.tokens_per_virtual_block
            chunk = self._chunk(seq.num_tokens - hit, budget)
            if not chunk:
                break
            missing = self.layout.num_virtual_blocks(hit + chunk) - len(cached)
            taken = missing + self.pool.num_unheld(cached)
            headroom = self.layout.num_virtual_blocks((len(self.running) + 1) * self.layout.block_size)
            if taken > self.pool.num_free or (self.running and self.pool.num_free - taken < headroom):
                break
            self.pool.take(cached)  # before allocating, which could otherwise evict them
            seq.block_table = cached + self.pool.allocate(missing)
            seq.num_computed_tokens, seq.num_named_blocks = hit, len(cached)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hit
            if self.enable_prefix_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += hit
            self.waiting.remove(seq)
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
        step_drafts = [drafts.get(s.seq_id, 0) for s in seqs]
        sample = [s.num_computed_tokens + n - d == s.num_tokens for s, n, d in zip(seqs, query_lens, step_drafts)]
        for seq in self.running:
            seq.num_spec_tokens = 0  # asked again for every step
        return ScheduledBatch(seqs, query_lens, context_lens, sample, step_drafts)

    def mark_computed(self, batch: ScheduledBatch) -> None:
        """The step ran: the requests' known tokens are in the cache. Drafts count once accepted."""
        for seq, n, num_drafts in zip(batch.seqs, batch.query_lens, batch.num_drafts):
            seq.num_computed_tokens += n - num_drafts
            if self.enable_prefix_caching:
                self._name_full_blocks(seq)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After the accepted drafts (and the token that follows them) joined a running `seq`: their K/V
        computed in the step count; blocks that only rejected drafts reached go back to the pool (their
        slots inside kept blocks lie past the computed length: never read, written again later)."""
        seq.num_computed_tokens += num_accepted
        # a draft model's cache holds its drafts' K/V: valid as far as they were accepted
        seq.draft_num_computed_tokens = min(seq.draft_num_computed_tokens, seq.num_computed_tokens)
        needed = self.layout.num_virtual_blocks(seq.num_tokens)
        if len(seq.block_table) > needed:
            self.pool.free(seq.block_table[needed:])
            del seq.block_table[needed:]
        if self.enable_prefix_caching:
            self._name_full_blocks(seq)


def _extend_hashes(seq: Sequence, per_block: int) -> None:
    """Name `seq`'s full blocks not named yet, reading only their tokens (not a copy of all of them)."""
    start = len(seq.block_hashes) * per_block
    if seq.num_tokens - start >= per_block:
        extend_block_hashes(seq.block_hashes, seq.token_ids(start, seq.num_tokens), per_block, start)
