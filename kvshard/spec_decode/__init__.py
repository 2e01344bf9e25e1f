"""Speculative decoding: proposers of draft tokens (n-gram prompt lookup, a draft model, the
checkpoint's MTP module), checked by the target model in one step. Every method implements
the interface of `proposer.py` (`Proposer` on rank 0, `DraftModule` on every rank for a
method with a model); the engine and the runner know only that interface.

Verifying k drafts is a step with k + 1 query tokens for the request (its last
accepted token and the drafts) against its cached context: the attention path
of a prefill chunk, exact under DCP for every interleave (docs/architecture.md,
"Speculative decoding").
"""

from kvshard.spec_decode.config import SpeculativeConfig, parse_speculative_config

__all__ = ["SpeculativeConfig", "parse_speculative_config"]
