"""Attention by concept: kernels that return the log-sum-exp, the LSE merge, per-step metadata,
and the DCP decode rhythm (backend) that models call once per layer."""

from kvshard.attention.backend import Attention
from kvshard.attention.kernels import attention_with_lse
from kvshard.attention.merge import merge_attention_states
from kvshard.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "Attention", "attention_with_lse", "merge_attention_states"]
