"""The merge of partial attentions over disjoint parts of the keys, by log-sum-exp.

All LSEs are natural-log and float32. A part that saw no key has `lse = -inf`
and output 0; it must weigh nothing, also when every part is empty
(`-inf - -inf` would be NaN, so weights are taken against a finite stand-in).
"""

from __future__ import annotations

import torch


def lse_weights(part_lse: torch.Tensor, total_lse: torch.Tensor) -> torch.Tensor:
    """exp(part - total), 0 where the part is empty, never NaN."""
    finite_total = torch.where(torch.isfinite(total_lse), total_lse, torch.zeros_like(total_lse))
    return torch.exp(part_lse - finite_total)


def merge_attention_states(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S partial attentions: outputs [S, ..., dv], lses [S, ...] -> ([..., dv], [...])."""
    total = torch.logsumexp(lses, dim=0)
    weights = lse_weights(lses, total)
    return (outputs * weights.unsqueeze(-1)).sum(0), total
