"""Drafts from the checkpoint's own multi-token-prediction (MTP) module (DeepSeek-V3, Kimi K2).

The MTP module reads the target's last-layer state at position p and the token at p + 1,
and predicts the token at p + 2; its one decoder layer has its own cache, sharded as the
target's (same DCP layout, same block ids), whose entry at p holds that pair. So each
target step also writes the entries of every row whose next token it knows (prompt rows,
and each row followed by a draft: valid as far as the drafts are accepted), and the ranks
keep the states of the rows the next step's drafts start from (each sampled request's last
known token and drafts: one of them is the last accepted). Nothing but row indices crosses
from rank 0 (in `MtpTargetRows` and `MtpDraftRows`, the only MTP data a StepPlan carries): the
states are replicated over TP, and stay on the ranks.

Drafting a request whose tokens end at position m (m = num_tokens - 1): pass 0 writes the
entry at m - 1 (kept state at m - 1, token m) and its output gives draft 1; pass j > 0
feeds draft j at m - 1 + j with pass j - 1's output state (the module applied again to its
own state, as vLLM does with one MTP layer) and gives draft j + 1. Entries written by
passes j > 0 are rewritten by the verification step. An entry depends on the token after
it, which a block's hash does not name, so prefix caching is off with MTP.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import torch

from kvshard.engine.sampler import sample_with_probs
from kvshard.engine.sequence import Sequence
from kvshard.engine.step_plan import StepPlan
from kvshard.forward_context import forward_context
from kvshard.kv.cache import allocate_kv_cache
from kvshard.models.deepseek import DeepseekMultiTokenPredictor

if TYPE_CHECKING:
    from kvshard.attention.metadata import AttentionMetadata
    from kvshard.config import EngineConfig
    from kvshard.engine.executor import Executor
    from kvshard.engine.scheduler import ScheduledBatch
    from kvshard.engine.step_plan import StepRows
    from kvshard.parallel import ParallelState


@dataclasses.dataclass(frozen=True)
class MtpTargetRows:
    """A target step's `StepPlan.spec`: which MTP cache entries it writes, which states the ranks keep."""

    # per request, its first rows whose next token the step knows (each row but a sampled last one:
    # a prompt chunk's last row is followed by the next chunk's first token, a row by the draft after it)
    num_known: list[int]
    next_token_ids: list[int]  # the token after each of those rows, request by request
    keep_rows: list[int]  # rows whose last-layer states the next draft pass starts from


@dataclasses.dataclass(frozen=True)
class MtpDraftRows:
    """A draft pass's `StepPlan.spec`: each request's row among the states the ranks kept last."""

    hidden_rows: list[int]


@dataclasses.dataclass(frozen=True)
class _Kept:
    row: int  # the request's first kept row on the ranks
    position: int  # the position of that row (its last known token in that step)
    num_rows: int  # 1 + the drafts it verified


class MtpProposer:
    """Rank 0's side (a `Proposer`, proposer.py)."""

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

    def wanted_drafts(self, seq: Sequence, limit: int) -> int:
        """Drafts only from a state the ranks kept (none right after a prefill chunk or a preemption)."""
        return limit if self._kept_row(seq) is not None else 0

    def draft(self, batch: ScheduledBatch) -> dict[int, torch.Tensor | None]:
        return self.propose(batch)

    def target_step(self, batch: ScheduledBatch, rows: StepRows) -> MtpTargetRows:
        """The MTP rows of the target step of `batch`: each row's next token, the rows to keep."""
        num_known: list[int] = []
        next_token_ids: list[int] = []
        keep_rows: list[int] = []
        kept: dict[int, _Kept] = {}
        for seq, ctx, n, r in zip(batch.seqs, batch.context_lens, batch.query_lens, rows.requests):
            following = rows.token_ids[r.start + 1 : r.start + n]
            if ctx + n < seq.num_tokens:  # a prompt chunk's last row: the next chunk's first token follows
                following += seq.token_ids(ctx + n, ctx + n + 1)
            num_known.append(len(following))
            next_token_ids += following
            if r.num_sampled:  # its last known token's row and one per draft
                kept[seq.seq_id] = _Kept(len(keep_rows), ctx + n - r.num_sampled, r.num_sampled)
                keep_rows += range(r.start + n - r.num_sampled, r.start + n)
        self.kept = kept
        return MtpTargetRows(num_known, next_token_ids, keep_rows)

    def propose(self, batch: ScheduledBatch) -> dict[int, torch.Tensor | None]:
        """Write the MTP module's drafts into `batch.drafts` (`batch.num_drafts` of them); returns, by
        seq_id, the distributions [drafts, V] sampled drafts were drawn from (None if greedy). Every
        decoding request with kept states takes pass 0, with drafts or not, so its cache stays whole."""
        active: list[int] = []  # indices into the batch
        rows: list[int] = []  # their rows among the states the ranks hold
        for i, seq in enumerate(batch.seqs):
            row = self._kept_row(seq)
            if row is not None and batch.context_lens[i] == seq.num_tokens - 1:
                active.append(i)
                rows.append(row)
        missing = [i for i, count in enumerate(batch.num_drafts) if count and i not in active]
        assert not missing, "drafts were scheduled for requests whose MTP states are not kept"
        drafts: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        step = 0
        while active:
            seqs = [batch.seqs[i] for i in active]
            wanted = [j for j, i in enumerate(active) if batch.num_drafts[i] > step]
            token_ids = [seq.last_token_id if step == 0 else drafts[i][-1] for i, seq in zip(active, seqs)]
            plan = StepPlan(token_ids, [1] * len(active), [seq.num_tokens - 2 + step for seq in seqs], None, wanted,
                            draft=True, spec=MtpDraftRows(rows), tables=self.executor.block_tables.changes(seqs))
            logits = self.executor.execute(plan).cpu()  # [len(wanted), V]
            for j, (token, row_probs) in zip(wanted, sample_with_probs(logits, [seqs[j] for j in wanted],
                                                                         self.default_generator,
                                                                         [drafts[active[j]] for j in wanted])):
                drafts[active[j]].append(token)
                if row_probs is not None:
                    probs[active[j]].append(row_probs)
            # the next pass: the requests that want another draft, from their rows of this pass's output
            rows = [j for j in wanted if batch.num_drafts[active[j]] > step + 1]
            active = [active[j] for j in rows]
            step += 1
        for i, request_drafts in drafts.items():
            if batch.num_drafts[i]:
                batch.drafts[i] = request_drafts
        return {batch.seqs[i].seq_id: torch.stack(p) if p else None for i, p in probs.items()}


class MtpModule:
    """Every rank's side (a `DraftModule`): the MTP layer, its one-layer cache, and the target's
    last-layer states the next draft pass starts from."""

    def __init__(self, config: EngineConfig, parallel: ParallelState, device: torch.device,
                 metadata: Callable[..., AttentionMetadata], load: Callable) -> None:
        target = config.model
        self.module = load(lambda: DeepseekMultiTokenPredictor(target.hf_config, target.dtype, parallel), target)
        self.kv_caches = allocate_kv_cache(config.mtp_kv_cache_spec, config.num_kv_blocks, config.cache.block_size,
                                           target.dtype, device)
        self.metadata = metadata
        self.device = device
        self.hidden: torch.Tensor | None = None  # [rows, D]: the states the next draft pass reads

    def run_draft(self, plan: StepPlan, input_ids: torch.Tensor, meta: AttentionMetadata,
                  rows: torch.Tensor) -> torch.Tensor:
        with forward_context(meta, self.kv_caches):
            hidden = self.module(input_ids, self.hidden[plan.spec.hidden_rows], meta.positions)  # [t, D]
        self.hidden = hidden  # the next draft starts from this one's output
        return self.module.compute_logits(hidden[rows])

    def after_target(self, plan: StepPlan, states: torch.Tensor) -> None:
        """Write the MTP cache entry of every row whose next token the plan gives (with the target's
        states of this step: exact as far as the drafts they follow are accepted, and rewritten from the
        first rejected one on), and keep the rows the next draft pass starts from. The states are
        replicated over TP after the last all-reduce, so every rank has them: nothing is sent."""
        spec: MtpTargetRows = plan.spec
        context_lens, query_lens, tables, known_rows, start = [], [], [], [], 0
        whole = plan.tables is None  # a plan built by hand carries whole tables, the engine's the slots
        for ctx, n, table, known in zip(plan.context_lens, plan.query_lens,
                                        plan.block_tables if whole else plan.tables.slots, spec.num_known):
            if known:
                context_lens.append(ctx)
                query_lens.append(known)
                tables.append(table)
                known_rows += range(start, start + known)
            start += n
        if known_rows:
            meta = self.metadata(context_lens, query_lens, tables) if whole else \
                self.metadata(context_lens, query_lens, slots=tables)
            next_ids = torch.tensor(spec.next_token_ids, dtype=torch.long, device=self.device)
            with forward_context(meta, self.kv_caches):
                self.module(next_ids, states[known_rows], meta.positions)
        self.hidden = states[spec.keep_rows]  # [kept rows, D]
