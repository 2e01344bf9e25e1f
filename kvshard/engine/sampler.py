"""Turn the last-position logits of a batch into next tokens, on rank 0.

One path for every row (`_sample_requests`), plain or verifying drafts: a request's rows
are its last known token's and one per draft (a plain request has the one). First the
logits processors of the requests that ask for them (`process_logits`, the one place
logits change before sampling: bad_words, min_tokens, logit_bias, then the repetition,
presence and frequency penalties, in vLLM's order); then greedy rows take the argmax,
and the others are tempered, cut by min-p, top-k and top-p (per-row values,
vectorised) and drawn with the request's own generator (rejection sampling where
drafts are verified), so a seeded request gives the same tokens whatever else is in
the batch. Log-probabilities are reported from the raw logits, as vLLM's default does.
`sample` (plain rows), `verify_drafts` (rows with drafts) and `sample_with_probs` (a
draft model's own proposals, which no processor changes) are that path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvshard.attention.fused_ops import ops_for
from kvshard.engine.sequence import Sequence
from kvshard.errors import RequestSettingsError
from kvshard.outputs import Logprob
from kvshard.structured.manager import apply_masks

NO_TOKEN_LEFT = ("no token is left to choose from: the request's min_tokens (with stop_token_ids and EOS), "
                 "bad_words, logit_bias and structured_outputs constraint together exclude every token")


def sample(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator) -> list[int | Exception]:
    """logits [b, V] float32 -> per row a token id, or the error that sampling this row raised.

    A row that fails (a distribution with NaN, say) must fail alone: the other rows still get their token.
    """
    return [outcome if isinstance(outcome, Exception) else outcome[0][0]
            for outcome in _sample_requests(logits, seqs, [[] for _ in seqs], default_generator)]


def process_logits(logits: torch.Tensor, seqs: list[Sequence],
                   drafts_before: list[list[int]] | None = None) -> torch.Tensor:
    """logits [b, V], row i the next token's for seqs[i] after its output and `drafts_before[i]` (the drafts
    a verification row follows) -> the logits its request's processors leave. Rows that use none are
    untouched; when no row uses one, the very same tensor comes back (no cost).

    As vLLM: the last token of each bad word (tokenized by SamplingParams.prepare) whose other tokens end the
    output, and, while the output is shorter than min_tokens, the EOS and stop tokens, become -inf; logit_bias
    is added; a token of the prompt or the output has its logit divided by repetition_penalty if positive,
    else multiplied; then frequency_penalty times its count in the output and presence_penalty if it is there
    are subtracted (OpenAI's formula).
    """
    rows = [i for i, seq in enumerate(seqs) if seq.params.uses_logits_processors]
    if not rows:
        return logits
    vocab = logits.shape[1]
    outputs = [seqs[i].output_token_ids + (drafts_before[i] if drafts_before else []) for i in rows]
    params = [seqs[i].params for i in rows]
    banned_rows: list[int] = []
    banned_tokens: list[int] = []
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    biases: list[float] = []
    for j, (p, output) in enumerate(zip(params, outputs)):
        banned: set[int] = set()
        for word in p._bad_words_token_ids or ():
            prefix = len(word) - 1
            if len(output) >= prefix and output[len(output) - prefix:] == word[:-1]:
                banned.add(word[-1])
        if len(output) < p.min_tokens:
            banned.update(p.stop_token_ids)
            if not p.ignore_eos:
                banned.update(p._eos_token_ids)
        banned = {t for t in banned if 0 <= t < vocab}
        banned_rows.extend([j] * len(banned))
        banned_tokens.extend(banned)
        for token, bias in (p.logit_bias or {}).items():
            bias_rows.append(j)
            bias_tokens.append(token)
            biases.append(float(bias))
    block = logits[rows].clone()  # [r, V]
    if banned_tokens:
        block[banned_rows, banned_tokens] = float("-inf")
    if bias_tokens:
        block.index_put_((torch.tensor(bias_rows), torch.tensor(bias_tokens)),
                         torch.tensor(biases, dtype=block.dtype), accumulate=True)
    penalised = [j for j, p in enumerate(params)
                 if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty]
    if penalised:
        sub = block[penalised]
        output_counts = _token_counts([outputs[j] for j in penalised], vocab)  # [r', V]
        repetition = torch.tensor([params[j].repetition_penalty for j in penalised], dtype=sub.dtype).unsqueeze(1)
        if bool((repetition != 1.0).any()):
            seen = (_token_counts([seqs[rows[j]].prompt_token_ids for j in penalised], vocab) > 0) | (output_counts > 0)
            factor = torch.where(seen, repetition, torch.ones_like(repetition))
            sub = torch.where(sub > 0, sub / factor, sub * factor)
        frequency = torch.tensor([params[j].frequency_penalty for j in penalised], dtype=sub.dtype).unsqueeze(1)
        presence = torch.tensor([params[j].presence_penalty for j in penalised], dtype=sub.dtype).unsqueeze(1)
        sub = sub - frequency * output_counts - presence * (output_counts > 0).to(sub.dtype)
        # a legal but extreme penalty (repetition_penalty 1e-300) overflows a logit to inf, which the softmax would
        # turn into NaN: such logits are held at the largest finite one (-inf, a banned token, stays)
        block[penalised] = sub.clamp(max=torch.finfo(sub.dtype).max)
    processed = logits.clone()
    processed[rows] = block
    apply_masks(processed, seqs, drafts_before)  # structured outputs: what the row's grammar forbids is -inf
    return processed


def _token_counts(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token occurs in each list."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width + 1), vocab, dtype=torch.long)  # column `vocab` takes the padding
    for i, tokens in enumerate(token_lists):
        if tokens:
            padded[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab + 1)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


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
    min_p = [p.min_p for p in params]
    if any(min_p):  # as vLLM, before top-k and top-p: below min_p times the top token's probability goes
        threshold = torch.tensor(min_p, dtype=sorted_probs.dtype).unsqueeze(1) * sorted_probs[:, :1]
        sorted_logits = sorted_logits.masked_fill(sorted_probs < threshold, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
    # keep a token if it is within top-k and the mass before it is below top-p; the first always stays
    # (a top_p below float32's range is 0 here, which would otherwise keep nothing)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank == 0) | ((rank < top_k) & (mass_before < top_p))
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return filtered.softmax(dim=-1)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of tied maxima; a NaN counts as the largest): `max(dim=-1)`'s indices, which
    torch's CPU kernel finds 2.7x faster than `argmax` over a decode step's [32, 49,152] float32 logits (0.41 against
    1.11 ms on two threads); float32 logits on a CPU with the kernel extension's fused operators, its `row_argmax`
    (one pass, the same indices; BENCHMARKS.md section 40), of which `max` is the oracle."""
    ops = ops_for(logits)
    if ops is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] \
            and logits.stride(1) == 1:
        return ops.row_argmax(logits).tolist()
    return logits.max(dim=-1).indices.tolist()


def sample_with_probs(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator,
                      drafts_before: list[list[int]] | None = None) -> list[tuple[int, torch.Tensor | None]]:
    """logits [b, V] -> per row a token and, for sampled rows, the distribution [V] it was drawn from
    (a draft model's q, which rejection sampling needs); greedy rows take the argmax. No logits
    processor applies (a proposal, not an output); a failing row raises.

    With `drafts_before` (the drafts each row's sequence has proposed this step before it), a row of a
    sequence under an output constraint is drawn from what its grammar allows after its output and those
    drafts, in place in `logits`: a draft the grammar forbids would only be rejected. A row after a drafted
    stop token is drawn as it is (`apply_masks`); verification ends the request before it."""
    if drafts_before is not None:
        apply_masks(logits, seqs, drafts_before)
    results: list[tuple[int, torch.Tensor | None]] = []
    for outcome in _sample_requests(logits, seqs, [[] for _ in seqs], default_generator, processors=False):
        if isinstance(outcome, Exception):
            raise outcome
        tokens, probs = outcome
        results.append((tokens[0], probs[0] if probs is not None else None))
    return results


def verify_drafts(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                  default_generator: torch.Generator,
                  draft_probs: list[torch.Tensor | None] | None = None) -> list[list[int] | Exception]:
    """logits [sum(k_i + 1), V]: per request, the rows of its last known token and its k_i drafts ->
    per request the accepted drafts and the token after them (1..k_i + 1 tokens), or its error.

    Each row's logits first go through its request's processors as if its drafts so far were output
    (`process_logits`), so penalties, min_tokens and bad_words see what plain decoding would have seen.
    Greedy: the drafts that equal the argmax, then the argmax: exactly the tokens of plain decoding.
    Otherwise rejection sampling against the distribution plain sampling draws from (temperature,
    top-k, top-p, filtered for all rows at once), so the tokens follow it whatever the drafts.
    `draft_probs[i]` [k_i, V]: the distributions request i's drafts were drawn from (None: chosen
    deterministically, as n-gram drafts are). A request without drafts is a plain row: its one token.
    """
    return [outcome if isinstance(outcome, Exception) else outcome[0]
            for outcome in _sample_requests(logits, seqs, drafts, default_generator, draft_probs)]


def _sample_requests(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                     default_generator: torch.Generator, draft_probs: list[torch.Tensor | None] | None = None,
                     processors: bool = True) -> list[tuple[list[int], torch.Tensor | None] | Exception]:
    """The one sampling path (see `verify_drafts`): per request its tokens and, if it samples, the
    filtered distributions [k_i + 1, V] of its rows (None if greedy), or the error it alone raised."""
    starts = [0]
    for request_drafts in drafts:
        starts.append(starts[-1] + len(request_drafts) + 1)
    if processors and any(seq.params.uses_logits_processors for seq in seqs):
        row_seqs = [seq for seq, request_drafts in zip(seqs, drafts) for _ in range(len(request_drafts) + 1)]
        before = [request_drafts[:j] for request_drafts in drafts for j in range(len(request_drafts) + 1)]
        logits = process_logits(logits, row_seqs, before)
        drafts = _cut_at_dead_rows(logits, drafts, starts)
    best = greedy_tokens(logits)
    outcomes: list[tuple[list[int], torch.Tensor | None] | Exception] = []
    for i, (seq, request_drafts) in enumerate(zip(seqs, drafts)):
        if request_drafts is None:
            outcomes.append(RequestSettingsError(NO_TOKEN_LEFT))
            continue
        rows = best[starts[i] : starts[i + 1]]
        accepted = 0
        while accepted < len(request_drafts) and request_drafts[accepted] == rows[accepted]:
            accepted += 1
        outcomes.append((request_drafts[:accepted] + [rows[accepted]], None))
    random = [i for i, seq in enumerate(seqs) if not seq.params.greedy and drafts[i] is not None]
    if not random:
        return outcomes
    # a request's rows past a cut (`_cut_at_dead_rows`) are left out
    row_index = [r for i in random for r in range(starts[i], starts[i] + len(drafts[i]) + 1)]
    try:
        probs = _filtered_probs(logits[row_index], [seqs[i].params for i in random
                                                    for _ in range(len(drafts[i]) + 1)])  # [r, V]
    except Exception:  # not attributable to one request: each alone says which one fails
        probs = None
    offset = 0
    for i in random:
        seq, count = seqs[i], len(drafts[i]) + 1
        try:
            if probs is not None:
                request_probs = probs[offset : offset + count]
            else:
                request_probs = _filtered_probs(logits[starts[i] : starts[i] + count], [seq.params] * count)
            q = draft_probs[i][: count - 1] if draft_probs is not None and draft_probs[i] is not None else None
            outcomes[i] = (rejection_sample(request_probs, drafts[i], q, seq.generator or default_generator),
                           request_probs)
        except Exception as error:
            outcomes[i] = error
        offset += count
    return outcomes


def _cut_at_dead_rows(logits: torch.Tensor, drafts: list[list[int]],
                      starts: list[int]) -> list[list[int] | None]:
    """Rows that the processors left no token (every logit -inf; a processor never makes NaN): a request whose
    first row is one gets None (it fails with RequestSettingsError, whatever its sampling); where row j > 0 is one,
    accepting the drafts up to it would leave no next token, so its drafts are cut to the first j - 1 and the
    token after them is drawn from row j - 1, as plain decoding would draw it (which fails the step after, if it
    takes draft j - 1)."""
    dead = logits.amax(dim=-1) == float("-inf")
    if not bool(dead.any()):
        return drafts
    dead_rows = dead.tolist()
    cut: list[list[int] | None] = []
    for i, request_drafts in enumerate(drafts):
        first_dead = next((j for j in range(len(request_drafts) + 1) if dead_rows[starts[i] + j]), None)
        if first_dead is None:
            cut.append(request_drafts)
        else:
            cut.append(None if first_dead == 0 else request_drafts[: first_dead - 1])
    return cut


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


def top_logprobs(logits: torch.Tensor, tokens: list[int], counts: list[int | None],
                 decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob] | None]:
    """Log-probabilities of the chosen token and the top-k alternatives, from the raw distribution, as vLLM's
    `Logprob`s: each with its rank in the distribution (1: the most likely; the alternatives 1..k) and, with
    `decode` (a token's text alone), its `decoded_token` when read."""
    logprobs = logits.log_softmax(dim=-1)
    result: list[dict[int, Logprob] | None] = []
    for row, (token, k) in enumerate(zip(tokens, counts)):
        if k is None:
            result.append(None)
            continue
        chosen = logprobs[row, token]
        entry = {token: Logprob(float(chosen), int((logprobs[row] > chosen).sum()) + 1, token=token, decode=decode)}
        if k:
            values, ids = logprobs[row].topk(k)
            for rank, (i, v) in enumerate(zip(ids.tolist(), values.tolist()), start=1):
                if i != token:
                    entry[i] = Logprob(v, rank, token=i, decode=decode)
        result.append(entry)
    return result
