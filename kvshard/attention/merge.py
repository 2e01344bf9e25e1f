"""The merge of partial attentions over disjoint parts of the keys, by log-sum-exp.

All LSEs are natural-log and float32. A part that saw no key has `lse = -inf`
and output 0; it must weigh nothing, also when every part is empty
(`-inf - -inf` would be NaN, so weights are taken against a finite stand-in).
"""

from __future__ import annotations

import torch


def lse_weights(part_lse: torch.Tensor, total_lse: torch.Tensor) -> torch.Tensor:
    """exp(part - total), 0 where the part is empty, never NaN."""
    finite_total = torch.nan_to_num(total_lse, nan=0.0, posinf=0.0, neginf=0.0)  # one op, not isfinite + where
    return (part_lse - finite_total).exp_()


def merge_attention_states(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S partial attentions: outputs [S, ..., dv], lses [S, ...] -> ([..., dv], [...])."""
    total = torch.logsumexp(lses, dim=0)
    weights = lse_weights(lses, total)
    return (outputs * weights.unsqueeze(-1)).sum(0), total
