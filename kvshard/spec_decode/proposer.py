"""The one interface of speculative decoding: what the engine asks of a proposer on rank 0, and what
the ranks run for it. n-gram (ngram.py), a draft model (draft_model.py) and the checkpoint's MTP
module (mtp.py) implement it; the engine step calls it the same way whatever the method.

A step with drafts, on rank 0 (`LLMEngine.step`):

1. before scheduling, `Proposer.wanted_drafts(seq, limit)` for each decoding request: how many
   drafts it asks room for (`Sequence.num_spec_tokens`); the scheduler grants what the token
   budget and the free blocks allow (`ScheduledBatch.num_drafts`), never preempting for a draft;
2. after scheduling (the drafts' blocks are held), `Proposer.draft(batch)` writes each request's
   `num_drafts[i]` drafts into `batch.drafts[i]` (a model runs its draft passes here, through the
   executor, as plans with `StepPlan.draft` set) and returns, by seq_id, the distributions
   sampled drafts were drawn from (rejection sampling needs them; None: chosen deterministically);
3. `Proposer.target_step(batch, rows)` gives what the target step must carry for the proposer's
   module on the ranks (`StepPlan.spec`, e.g. mtp.MtpTargetRows), or None;
4. the target verifies the drafts (`sampler.verify_drafts`, the one sampling path of every row).

On every rank, a proposer with a model of its own has a `DraftModule` (built by
`make_draft_module`, loaded with the loader the target is loaded with): it owns that model
and its KV cache (sharded as the target's, addressed by the same block ids), runs the plans marked
`draft`, and sees the target's last-layer states of every target step (`after_target`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from kvshard.attention.metadata import AttentionMetadata
    from kvshard.config import EngineConfig
    from kvshard.engine.executor import Executor
    from kvshard.engine.scheduler import ScheduledBatch
    from kvshard.engine.sequence import Sequence
    from kvshard.engine.step_plan import StepPlan, StepRows
    from kvshard.parallel import ParallelState
    from kvshard.spec_decode.config import SpeculativeConfig


@runtime_checkable
class Proposer(Protocol):
    """Rank 0's side of a speculative-decoding method."""

    def wanted_drafts(self, seq: Sequence, limit: int) -> int:
        """Before scheduling, for a decoding request: the drafts it asks room for, 0..limit."""
        ...

    def draft(self, batch: ScheduledBatch) -> dict[int, torch.Tensor | None]:
        """Write `batch.num_drafts[i]` drafts into `batch.drafts[i]`; return by seq_id the distributions
        [drafts, V] that sampled drafts were drawn from (None where chosen deterministically)."""
        ...

    def target_step(self, batch: ScheduledBatch, rows: StepRows) -> object | None:
        """What the target step of `batch` carries for the proposer's module on the ranks (StepPlan.spec)."""
        ...


@runtime_checkable
class DraftModule(Protocol):
    """Every rank's side of a method with a model: the model, its KV cache, its per-step state."""

    kv_caches: list  # its KV cache layers (counted in ModelRunner.kv_cache_bytes)

    def run_draft(self, plan: StepPlan, input_ids: torch.Tensor, meta: AttentionMetadata,
                  rows: torch.Tensor) -> torch.Tensor:
        """A plan marked `draft`: float32 logits of `rows` [len(rows), V]."""
        ...

    def after_target(self, plan: StepPlan, states: torch.Tensor) -> None:
        """After the target's layers ran `plan`: its last-layer states [t, D], before the final norm."""
        ...


class NoProposer:
    """Without speculative decoding: no request asks for drafts."""

    def wanted_drafts(self, seq: Sequence, limit: int) -> int:
        return 0

    def draft(self, batch: ScheduledBatch) -> dict[int, torch.Tensor | None]:
        return {}

    def target_step(self, batch: ScheduledBatch, rows: StepRows) -> object | None:
        return None


def make_proposer(speculative: SpeculativeConfig | None, executor: Executor,
                  default_generator: torch.Generator) -> Proposer:
    """Rank 0's proposer for `--speculative-config` (NoProposer without one)."""
    from kvshard.spec_decode.draft_model import DraftModelProposer
    from kvshard.spec_decode.mtp import MtpProposer
    from kvshard.spec_decode.ngram import NgramProposer

    if speculative is None:
        return NoProposer()
    if speculative.method == "ngram":
        return NgramProposer(speculative.prompt_lookup_min, speculative.prompt_lookup_max)
    return {"draft_model": DraftModelProposer, "mtp": MtpProposer}[speculative.method](executor, default_generator)


def make_draft_module(config: EngineConfig, parallel: ParallelState, device: torch.device,
                      metadata: Callable[..., AttentionMetadata], load: Callable) -> DraftModule | None:
    """This rank's module for the configured method, loaded; None for a method without a model.
    `metadata(context_lens, query_lens, block_tables)` builds this rank's attention metadata;
    `load(build, model_config)` is the rank's one loader (engine/model_runner.py's `load_module`)."""
    from kvshard.spec_decode.draft_model import DraftModelModule
    from kvshard.spec_decode.mtp import MtpModule

    method = config.speculative.method if config.speculative is not None else None
    modules = {"draft_model": DraftModelModule, "mtp": MtpModule}
    return modules[method](config, parallel, device, metadata, load) if method in modules else None
