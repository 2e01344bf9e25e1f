"""Per-request sampling settings, named as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field


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
        """Raise ValueError with what to change; the server answers 400 with this text."""
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(_is_number(self.temperature) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}")
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0), f"top_k must be -1 (off) or >= 0, got {self.top_k!r}")
        check(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
              f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers")
        check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
              f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
