"""Per-request sampling settings, named as in vLLM."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Integers travel as int64 (torch tensors, generator seeds): anything wider is refused at the door.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # OpenAI's limit on alternatives per token
MAX_STOP_STRINGS = 64  # every stop string is searched for at every step
MAX_STOP_LENGTH = 1024  # characters; a stream holds back the longest stop string minus one


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k log-probabilities to return per generated token
    # disaggregated prefill/decode (kvshard/disagg): do_remote_decode on a producer, do_remote_prefill on a consumer
    kv_transfer_params: dict | None = None
    prompt_logprobs: int | None = None  # top-k log-probabilities to return per prompt token after the first

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the field first (the server answers 400 with this text, `param` = that word)."""
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(_is_int(self.n, 1), f"n must be an integer >= 1, got {self.n!r}")
        check(_is_finite(self.temperature) and self.temperature >= 0,
              f"temperature must be a finite number >= 0, got {self.temperature!r}")
        check(_is_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(_is_int(self.top_k, -1), f"top_k must be -1 (off) or an integer >= 0, got {self.top_k!r}")
        check(self.seed is None or _is_int(self.seed, INT64_MIN),
              f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed!r}")
        check(self.max_tokens is None or _is_int(self.max_tokens, 1),
              f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        check(len(self.stop) <= MAX_STOP_STRINGS,
              f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        check(all(len(s) <= MAX_STOP_LENGTH for s in self.stop),
              f"stop strings must be at most {MAX_STOP_LENGTH} characters long")
        check(all(_is_int(t, 0) for t in self.stop_token_ids),
              f"stop_token_ids must be integers in [0, {INT64_MAX}]")
        check(self.kv_transfer_params is None or self.n == 1, "n must be 1 when kv_transfer_params is given")
        check(self.logprobs is None or (_is_int(self.logprobs, 0) and self.logprobs <= MAX_LOGPROBS),
              f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs, 0) and self.prompt_logprobs <= MAX_LOGPROBS),
              f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")


def _is_int(value, minimum: int) -> bool:
    """An int (not a bool) in [minimum, INT64_MAX]."""
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= INT64_MAX


def _is_finite(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False
