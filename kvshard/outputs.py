"""What `LLM.generate` and the engine return, shaped as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    logprobs: list[dict[int, float]] | None = None  # one {token_id: logprob} per generated token
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
