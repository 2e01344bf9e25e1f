"""Exact attention over parts of the keys, and the merge of those parts by log-sum-exp.

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


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of the scores.

    q [g, s, H, dk], k [g, L, Hk, dk], v [g, L, Hk, dv], bias [g, s, L] added to the scores
    (0 where a query may attend, -inf where not). Query head h reads KV head h // (H / Hk).
    Returns o [g, s, H, dv], lse [g, s, H], float32; a query with no allowed key gets o = 0, lse = -inf.
    """
    g, s, num_heads, dk = q.shape
    length, num_kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    rep = num_heads // num_kv_heads
    qf = q.float().view(g, s, num_kv_heads, rep, dk).permute(0, 2, 3, 1, 4).reshape(g, num_kv_heads, rep * s, dk)
    kf = k.float().permute(0, 2, 3, 1)  # [g, Hk, dk, L]
    scores = torch.matmul(qf, kf).mul_(scale).view(g, num_kv_heads, rep, s, length)
    scores.add_(bias[:, None, None])
    # one pass of exp: o = softmax(scores) @ v, lse = max + log(sum(exp(scores - max)))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max.masked_fill_(~torch.isfinite(row_max), 0.0)  # rows with no key: everything below stays 0
    weights = scores.sub_(row_max).exp_().view(g, num_kv_heads, rep * s, length)
    total = weights.sum(dim=-1)  # [g, Hk, rep*s]
    o = torch.matmul(weights, v.float().transpose(1, 2))  # [g, Hk, rep*s, dv]
    empty = total == 0
    o = o.div_(total.masked_fill(empty, 1.0).unsqueeze(-1))
    lse = (total.log() + row_max.view(g, num_kv_heads, rep * s)).masked_fill_(empty, float("-inf"))
    o = o.view(g, num_kv_heads, rep, s, dv).permute(0, 3, 1, 2, 4).reshape(g, s, num_heads, dv)
    return o, lse.view(g, num_kv_heads, rep, s).permute(0, 3, 1, 2).reshape(g, s, num_heads)
