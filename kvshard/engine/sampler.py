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


def sample_with_probs(logits: torch.Tensor, seqs: list[Sequence],
                      default_generator: torch.Generator) -> list[tuple[int, torch.Tensor | None]]:
    """logits [b, V] -> per row a token and, for sampled rows, the distribution [V] it was drawn from
    (a draft model's q, which rejection sampling needs); greedy rows take the argmax."""
    best = logits.argmax(dim=-1).tolist()
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    results: list[tuple[int, torch.Tensor | None]] = [(token, None) for token in best]
    if random_rows:
        probs = _filtered_probs(logits[random_rows], [seqs[i].params for i in random_rows])  # [r, V]
        for row, i in zip(probs, random_rows):
            results[i] = (_draw(row, seqs[i].generator or default_generator), row)
    return results


def verify_drafts(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                  default_generator: torch.Generator,
                  draft_probs: list[torch.Tensor | None] | None = None) -> list[list[int] | Exception]:
    """logits [sum(k_i + 1), V]: per request, the rows of its last known token and its k_i drafts ->
    per request the accepted drafts and the token after them (1..k_i + 1 tokens), or its error.

    Greedy: the drafts that equal the argmax, then the argmax: exactly the tokens of plain decoding.
    Otherwise rejection sampling against the distribution plain sampling draws from (temperature,
    top-k, top-p, filtered for all rows at once), so the tokens follow it whatever the drafts.
    `draft_probs[i]` [k_i, V]: the distributions request i's drafts were drawn from (None: chosen
    deterministically, as n-gram drafts are).
    """
    starts = [0]
    for request_drafts in drafts:
        starts.append(starts[-1] + len(request_drafts) + 1)
    best = logits.argmax(dim=-1).tolist()
    outcomes: list[list[int] | Exception] = []
    for i, (seq, request_drafts) in enumerate(zip(seqs, drafts)):
        rows = best[starts[i] : starts[i + 1]]
        accepted = 0
        while accepted < len(request_drafts) and request_drafts[accepted] == rows[accepted]:
            accepted += 1
        outcomes.append(request_drafts[:accepted] + [rows[accepted]])
    random = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    if not random:
        return outcomes
    row_index = [r for i in random for r in range(starts[i], starts[i + 1])]
    try:
        probs = _filtered_probs(logits[row_index], [seqs[i].params for i in random
                                                    for _ in range(starts[i], starts[i + 1])])  # [r, V]
    except Exception:  # not attributable to one request: each alone says which one fails
        probs = None
    offset = 0
    for i in random:
        seq, count = seqs[i], starts[i + 1] - starts[i]
        try:
            if probs is not None:
                request_probs = probs[offset : offset + count]
            else:
                request_probs = _filtered_probs(logits[starts[i] : starts[i + 1]], [seq.params] * count)
            q = draft_probs[i] if draft_probs is not None else None
            outcomes[i] = rejection_sample(request_probs, drafts[i], q, seq.generator or default_generator)
        except Exception as error:
            outcomes[i] = error
        offset += count
    return outcomes


def rejection_sample(target_probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator) -> list[int]:
    """Speculative sampling: target_probs [k+1, V] (row i: the distribution after i drafts), drafts
    proposed from draft_probs [k, V] (None: deterministic proposals, q = one-hot) -> accepted drafts
    and one more token.

    Draft x is kept with probability min(1, p(x) / q(x)); the first rejected one is replaced by a draw
    from the residual max(p - q, 0) (for a one-hot q: p without x), renormalised; if all are kept the
    last row gives a bonus token. Every emitted token is then distributed as p.
    """
    tokens: list[int] = []
    for i, draft in enumerate(drafts):
        p = target_probs[i]  # [V]
        q_draft = 1.0 if draft_probs is None else float(draft_probs[i, draft])
        if float(torch.rand(1, generator=generator)) * q_draft < float(p[draft]):
            tokens.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp(min=0.0)
        return tokens + [_draw(residual / residual.sum(), generator)]
    return tokens + [_draw(target_probs[len(drafts)], generator)]


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
