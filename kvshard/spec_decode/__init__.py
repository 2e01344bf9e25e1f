"""Speculative decoding: proposers of draft tokens (n-gram prompt lookup, a draft model, the
checkpoint's MTP module), checked by the target model in one step.

Verifying k drafts is a step with k + 1 query tokens for the request (its last
accepted token and the drafts) against its cached context: the attention path
of a prefill chunk, exact under DCP for every interleave (docs/architecture.md,
"Speculative decoding").
"""

from kvshard.spec_decode.config import SpeculativeConfig, parse_speculative_config

__all__ = ["SpeculativeConfig", "parse_speculative_config"]
