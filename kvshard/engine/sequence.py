"""One generated sequence: its tokens, where its KV lives, and how far the model has read it."""

from __future__ import annotations

import enum
import itertools

import torch

from kvshard.engine.block_tables import BlockTable
from kvshard.kv.prefix_cache import BlockHash
from kvshard.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
        generator: torch.Generator | None,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # position among the request's n samples
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0  # the generated tokens' logprobs summed (kept with output_logprobs)
        self.stop_reason: int | str | None = None  # the stop string or stop_token_ids token that ended it
        # {token: logprob} of prompt token p + 1 given tokens 0..p, for p = 0, 1, ...: kept by the request's
        # first sequence when it asks for prompt logprobs (its siblings read the same prompt), else None
        self.prompt_logprobs: list[dict[int, float]] | None = (
            [] if params.prompt_logprobs is not None and index == 0 else None)
        self.params = params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.block_table = []  # virtual block ids, shared by every rank of the DCP group (a BlockTable)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_spec_tokens = 0  # drafts its proposer asks room for in the next step (after all_token_ids)
        self.draft_num_computed_tokens = 0  # tokens whose K/V are in a draft model's cache
        self.block_hashes: list[BlockHash] = []  # names of the full virtual blocks of all_token_ids so far
        self.num_named_blocks = 0  # blocks of block_table named in the prefix cache, from the start
        self.num_cached_tokens: int | None = None  # prompt tokens reused from the cache at first admission
        self.finish_reason: str | None = None
        self.text = ""
        # the output's constraint (kvshard/structured), once params.structured_outputs has compiled
        self.grammar = None

    @property
    def block_table(self) -> BlockTable:
        return self._block_table

    @block_table.setter
    def block_table(self, blocks: list[int]) -> None:
        """A new table (a list is copied into a BlockTable: the plans send it whole once, then its changes)."""
        self._block_table = blocks if isinstance(blocks, BlockTable) else BlockTable(blocks)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] without building all_token_ids (whose copy grows with the context)."""
        prompt = len(self.prompt_token_ids)
        if stop <= prompt:
            return self.prompt_token_ids[start:stop]
        if start >= prompt:
            return self.output_token_ids[start - prompt : stop - prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - prompt]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def pending_prompt_logprobs(self, start: int, end: int) -> range:
        """Positions in [start, end) whose logits the prompt logprobs still lack (a preempted request
        recomputes positions it already has)."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(end, len(self.prompt_token_ids) - 1))

    @property
    def waits_for_grammar(self) -> bool:
        """Its output constraint is still compiling: the scheduler leaves it waiting."""
        return self.grammar is None and self.params.structured_outputs is not None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, {self.status.value})")
