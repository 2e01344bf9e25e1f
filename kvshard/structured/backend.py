"""The interface a grammar backend implements (xgrammar today; llguidance would fit the same two classes).

A backend compiles one request's `StructuredOutputsParams` into an immutable compiled grammar (thread-safe:
compiles run in a thread pool), and makes one `Grammar` (a matcher, with state) per generated sequence from
it. Masks are bitmasks: int32 [rows, ceil(vocab / 32)], bit j of a row set when token j is allowed (the
layout xgrammar and llguidance share).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvshard.sampling_params import StructuredOutputsParams


class Grammar(ABC):
    """One sequence's position in its constraint: which tokens may come next, and how to move."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (no change of state)."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by one token; False (and no change) when the constraint does not allow it here, or has ended
        (its stop token taken)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The constraint is complete and its stop token (the model's EOS) was accepted."""

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the constraint allows from here; the state is left unchanged."""
        accepted = 0
        for token in tokens:
            if not self.accept_token(token):
                break
            accepted += 1
        if accepted:
            self.rollback(accepted)
        return accepted


class Backend(ABC):
    """Compiles constraints for one tokenizer and vocabulary (`vocab_size`: the model's, which may be larger
    than the tokenizer's; ids past the tokenizer's are never allowed). `stop_token_ids`: the engine's EOS,
    which the grammar allows, alone, once the output is complete."""

    name: str

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size

    @abstractmethod
    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar, or ValueError naming the field (`structured_outputs.regex: ...`)."""

    @abstractmethod
    def compiled_size_bytes(self, compiled) -> int:
        """Host memory a compiled grammar holds (what the cache counts)."""

    @abstractmethod
    def new_grammar(self, compiled) -> Grammar:
        """A fresh matcher at the start of the output."""

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """int32 [rows, ceil(vocab / 32)], every token allowed."""
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    @abstractmethod
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """In place, for each row r in `rows`: logits[r, j] = -inf where bit j of bitmask[r] is clear
        (logits [b, V] float32 on the host, bitmask [b, ceil(V / 32)])."""
