"""`--speculative-config`: vLLM's JSON fields, checked before any process starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvshard.errors import ConfigError, json_object_setting

METHODS = ("ngram", "draft_model")
_FIELDS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int  # k: drafts verified per step at most
    prompt_lookup_max: int = 5  # ngram: longest suffix looked up in the request's tokens
    prompt_lookup_min: int = 1  # ngram: shortest
    model: str | None = None  # draft_model: its checkpoint, as given
    draft_model_config: Any = field(default=None, repr=False)  # draft_model: its ModelConfig, once loaded

    def describe(self) -> str:
        if self.method == "ngram":
            return (f"speculative decoding: ngram (prompt lookup), {self.num_speculative_tokens} draft tokens, "
                    f"n-grams of {self.prompt_lookup_min}..{self.prompt_lookup_max} tokens")
        return (f"speculative decoding: draft model {self.model}, {self.num_speculative_tokens} draft tokens, "
                "its KV cache sharded as the target's (same blocks)")


def parse_speculative_config(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """A JSON string (the flag) or a dict (`LLM(speculative_config=...)`) -> the config, or None."""
    if value is None or value == "" or value == {}:
        return None
    value = json_object_setting(value, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    unknown = set(value) - _FIELDS
    if unknown:
        raise ConfigError(f"speculative_config has unknown fields {sorted(unknown)}: the fields are {sorted(_FIELDS)}")
    method = value.get("method", "draft_model" if "model" in value else None)
    value = {**value, "method": method}
    if method not in METHODS:
        raise ConfigError(f"speculative_config method {method!r} is not supported: use one of {list(METHODS)}")
    if "num_speculative_tokens" not in value:
        raise ConfigError("speculative_config needs num_speculative_tokens (draft tokens per step, e.g. 3)")
    if (method == "draft_model") != ("model" in value):
        raise ConfigError('speculative_config: give "model" (the draft checkpoint) with method "draft_model" '
                          "and only then")
    config = SpeculativeConfig(**value)
    for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        number = getattr(config, name)
        if not isinstance(number, int) or isinstance(number, bool) or number < 1:
            raise ConfigError(f"speculative_config {name} must be a positive integer, got {number!r}")
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise ConfigError(f"speculative_config prompt_lookup_min={config.prompt_lookup_min} exceeds "
                          f"prompt_lookup_max={config.prompt_lookup_max}: lower the minimum or raise the maximum")
    return config
