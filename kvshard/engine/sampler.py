"""Turn the last-position logits of a batch into next tokens, on rank 0.

Greedy rows take the argmax; the others are tempered, cut by top-k and top-p
(per-row values, vectorised) and drawn with the request's own generator, so a
seeded request gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch

from kvshard.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator) -> list[int | Exception]:
    """logits [b, V] float32 -> per row a token id, or the error that sampling this row raised.

    A row that fails (a distribution with NaN, say) must fail alone: the other rows still get their token.
    """
    outcomes: list[int | Exception] = logits.argmax(dim=-1).tolist()
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if not random_rows:
        return outcomes
    params = [seqs[i].params for i in random_rows]
    try:
        probs = _filtered_probs(logits[random_rows], params)  # [r, V]
    except Exception:  # not attributable to a row within the batch: each row alone says which one fails
        probs = None
    for j, i in enumerate(random_rows):
        try:
            row = probs[j] if probs is not None else _filtered_probs(logits[i : i + 1], [params[j]])[0]
            outcomes[i] = _draw(row, seqs[i].generator or default_generator)
        except Exception as error:
            outcomes[i] = error
    return outcomes


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token id from a distribution [V]."""
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def _filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
    # extreme but legal temperatures must not turn into 0 or inf in float32
    finfo = torch.finfo(logits.dtype)
    temperature = torch.tensor([p.temperature for p in params]).clamp(finfo.tiny, finfo.max).unsqueeze(1)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[1] for p in params]).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
    # shifted so the top logit is 0: dividing by a tiny temperature gives -inf elsewhere, never inf - inf
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    sorted_logits, order = (shifted / temperature).sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1]).unsqueeze(0)
    sorted_probs = sorted_logits.softmax(dim=-1)
    # keep a token if it is within top-k and the mass before it is below top-p; the first always stays
    # (a top_p below float32's range is 0 here, which would otherwise keep nothing)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank == 0) | ((rank < top_k) & (mass_before < top_p))
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return filtered.softmax(dim=-1)


def top_logprobs(logits: torch.Tensor, tokens: list[int], counts: list[int | None]) -> list[dict[int, float] | None]:
    """Log-probabilities of the chosen token and the top-k alternatives, from the raw distribution."""
    logprobs = logits.log_softmax(dim=-1)
    result: list[dict[int, float] | None] = []
    for row, (token, k) in enumerate(zip(tokens, counts)):
        if k is None:
            result.append(None)
            continue
        entry = {token: float(logprobs[row, token])}
        if k:
            values, ids = logprobs[row].topk(k)
            entry.update({int(i): float(v) for i, v in zip(ids, values)})
        result.append(entry)
    return result
