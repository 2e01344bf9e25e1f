"""Sampled tokens -> text, stop conditions and `RequestOutput`s, on rank 0.

Text grows by one token at a time with the `tokenizers` library's streaming
decoder (`DecodeStream`), so a step costs O(1) per sequence instead of
decoding every output token again. Each sequence's decoder first reads the end
of its prompt, so that the first output token reads as it does after the
prompt (SentencePiece decoders drop a leading space at the start of a text:
" Paris" would come out "Paris"), as vLLM does. Stop strings are searched only
where the new text could complete one, and the text is cut before the first
match; a stop token (EOS, `stop_token_ids`) ends the output without its text,
as vLLM's (its id stays in `token_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from kvshard.engine.sequence import Sequence
from kvshard.outputs import CompletionOutput, RequestOutput


@dataclass
class Request:
    """One request on rank 0: its n sequences and how it was asked for."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float
    error: str | None = None
    invalid_request: bool = False  # the error is the request's own settings' (errors.RequestSettingsError)


class OutputProcessor:
    def __init__(self, tokenizer, hf_config, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        # the streaming decoder works on the `tokenizers` object under a transformers fast tokenizer
        self._backend = tokenizer.backend_tokenizer if tokenizer is not None else None
        self.max_model_len = max_model_len
        self._streams: dict[int, DecodeStream] = {}  # by seq_id

    @property
    def eos_token_ids(self) -> set[int]:
        eos = self.hf_config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def append_token(self, seq: Sequence, token: int) -> str | None:
        """Add a sampled token to its sequence; the reason it finishes, or None."""
        seq.output_token_ids.append(token)
        params = seq.params
        stop_token = (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids
        if stop_token and token in params.stop_token_ids:
            seq.stop_reason = token  # vLLM's: the stop_token_ids token; None for EOS
        if stop_token and not params.include_stop_str_in_output:
            return "stop"  # its text is not part of the output (vLLM's, without include_stop_str_in_output)
        previous_len = len(seq.text)
        if self._backend is not None:
            seq.text += self._stream(seq).step(self._backend, token) or ""  # None: a character is incomplete
        if stop_token:
            return "stop"
        if _stop_strings_apply(seq):
            found = [(at, stop) for stop in params.stop
                     if (at := seq.text.find(stop, max(0, previous_len - len(stop) + 1))) != -1]
            if found:
                at, stop = min(found)
                seq.text = seq.text[:at + len(stop)] if params.include_stop_str_in_output else seq.text[:at]
                seq.stop_reason = stop
                return "stop"
        if params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _stream(self, seq: Sequence) -> DecodeStream:
        """The sequence's streaming decoder, made at its first token and primed with the end of its prompt."""
        stream = self._streams.get(seq.seq_id)
        if stream is None:
            stream = DecodeStream(skip_special_tokens=True)
            for token in _prompt_context(self.tokenizer, seq.prompt_token_ids):
                stream.step(self._backend, token)
            self._streams[seq.seq_id] = stream
        return stream

    def output(self, request: Request) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=seq.index, text=seq.text, token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason,
                logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
                stop_reason=seq.stop_reason,
            )
            for seq in request.seqs
        ]
        finished = all(seq.is_finished for seq in request.seqs)
        if finished:
            self.release(request)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished,
                             num_cached_tokens=request.seqs[0].num_cached_tokens, error=request.error,
                             invalid_request=request.invalid_request, prompt_logprobs=prompt_logprobs(request))

    def release(self, request: Request) -> None:
        for seq in request.seqs:
            self._streams.pop(seq.seq_id, None)


# The prompt tokens a sequence's decoder reads before its first output token: from MIN to MAX of the prompt's last
# ones, the fewest that decode to whole characters (a piece of a character would come out with the first token).
PROMPT_CONTEXT_MIN, PROMPT_CONTEXT_MAX = 4, 24


def _prompt_context(tokenizer, prompt: list[int]) -> list[int]:
    if len(prompt) <= PROMPT_CONTEXT_MIN:
        return prompt
    for length in range(PROMPT_CONTEXT_MIN, min(len(prompt), PROMPT_CONTEXT_MAX) + 1):
        suffix = prompt[-length:]
        if "\ufffd" not in tokenizer.decode(suffix, skip_special_tokens=True):
            return suffix
    return prompt[-PROMPT_CONTEXT_MAX:]


def _stop_strings_apply(seq: Sequence) -> bool:
    """Whether a stop string may end `seq` now: as vLLM, not before its output is longer than min_tokens (the
    sampler holds EOS and stop_token_ids back until then; a stop string in the text before that is not one)."""
    return bool(seq.params.stop) and len(seq.output_token_ids) > seq.params.min_tokens


def prompt_logprobs(request: Request) -> list[dict[int, float] | None] | None:
    """The request's prompt logprobs as vLLM returns them (kept by its first sequence), or None if not asked."""
    known = request.seqs[0].prompt_logprobs
    return None if known is None else [None, *known]
