"""What `LLM.generate` and the engine return, shaped as in vLLM."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class Logprob(float):
    """One log-probability of an output's (or a prompt's) logprobs: the number itself, so that it adds, compares
    and serialises as a float, with vLLM's `Logprob` fields, so that code written for vLLM reads it as it reads
    vLLM's: `logprob`, `rank` (1 for the most likely token of the distribution) and `decoded_token` (the token's
    text alone, decoded when first read: the engine step does not pay for it)."""

    __slots__ = ("rank", "_text", "_token", "_decode")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None,
                token: int | None = None, decode: Callable[[int], str] | None = None) -> Logprob:
        value = super().__new__(cls, logprob)
        value.rank, value._text, value._token, value._decode = rank, decoded_token, token, decode
        return value

    @property
    def logprob(self) -> float:
        return float(self)

    @property
    def decoded_token(self) -> str | None:
        if self._text is None and self._decode is not None and self._token is not None:
            self._text = self._decode(self._token)
        return self._text

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    logprobs: list[dict[int, Logprob]] | None = None  # one {token_id: logprob} per generated token
    # vLLM's: the sum of the generated tokens' logprobs (with SamplingParams.logprobs, else None), and what ended
    # the output with finish_reason "stop": the stop string, or the token of stop_token_ids (None for EOS)
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int | None = None  # prompt tokens whose KV came from the prefix cache; None before admission
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token
    # {token_id: logprob} holding that token and the top-k, given the tokens before it
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # why the request ended early (sampling or output processing failed for it); finished is then True, and
    # every sequence still running then has finish_reason "error" (one of its n that had finished keeps its own
    # reason: what a stream already sent). The other requests and the engine go on.
    error: str | None = None
    # the error came from the request's own settings (errors.RequestSettingsError: e.g. min_tokens, bad_words and
    # a constraint that leave no token): the client can fix it, and an API server answers 400
    invalid_request: bool = False
