"""Attention with log-sum-exp, the LSE merge, and the DCP decode rhythm."""

from kvshard.attention.backend import DCPAttention
from kvshard.attention.merge import attention_with_lse, merge_attention_states
from kvshard.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "DCPAttention", "attention_with_lse", "merge_attention_states"]
