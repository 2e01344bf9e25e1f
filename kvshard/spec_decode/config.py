"""`--speculative-config`: vLLM's JSON fields, checked before any process starts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvshard.errors import ConfigError, json_object_setting

METHODS = ("ngram", "draft_model", "mtp")
# what a DeepSeek-V3 checkpoint stores for its MTP module, under model.layers.{num_hidden_layers}.
MTP_TENSORS = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
               "shared_head.head.weight", "input_layernorm.weight", "post_attention_layernorm.weight")
_FIELDS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram", "draft_model" or "mtp"
    num_speculative_tokens: int  # k: drafts verified per step at most
    prompt_lookup_max: int = 5  # ngram: longest suffix looked up in the request's tokens
    prompt_lookup_min: int = 1  # ngram: shortest
    model: str | None = None  # draft_model: its checkpoint, as given
    draft_model_config: Any = field(default=None, repr=False)  # draft_model: its ModelConfig, once loaded

    def describe(self) -> str:
        if self.method == "ngram":
            return (f"speculative decoding: ngram (prompt lookup), {self.num_speculative_tokens} draft tokens, "
                    f"n-grams of {self.prompt_lookup_min}..{self.prompt_lookup_max} tokens")
        if self.method == "mtp":
            return (f"speculative decoding: mtp (the checkpoint's multi-token-prediction layer), "
                    f"{self.num_speculative_tokens} draft tokens, its one-layer KV cache sharded as the target's "
                    "(same blocks); prefix caching off")
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


def check_mtp_checkpoint(model) -> None:
    """`model` (a ModelConfig) must be a DeepSeek-V3 checkpoint that carries its MTP layer."""
    cfg = model.hf_config
    if model.architecture != "DeepseekV3ForCausalLM":
        raise ConfigError(f'speculative_config method "mtp" needs a DeepSeek-V3 / Kimi K2 checkpoint with MTP layers; '
                          f"{model.path} is {model.architecture}: use ngram or a draft model")
    if not getattr(cfg, "num_nextn_predict_layers", 0):
        raise ConfigError(f'speculative_config method "mtp": {model.path} has no MTP layers '
                          "(num_nextn_predict_layers is absent or 0): use ngram or a draft model")
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    names = _tensor_names(model.path)
    missing = [name for name in MTP_TENSORS if prefix + name not in names]
    if missing or not any(name.startswith(prefix + "self_attn.") for name in names):
        raise ConfigError(f'speculative_config method "mtp": {model.path} declares num_nextn_predict_layers='
                          f"{cfg.num_nextn_predict_layers} but lacks the MTP weights under {prefix}* "
                          f"(e.g. {prefix}{(missing or ['self_attn.*'])[0]}): use a checkpoint that keeps them")


def _tensor_names(path) -> set[str]:
    """Every tensor name of the checkpoint's weight files (those the weights are read from), a safetensors
    file's from its header alone."""
    from kvshard.models.loader import checkpoint_files, checkpoint_tensors

    names: set[str] = set()
    for file in checkpoint_files(path):
        if file.suffix != ".safetensors":
            names.update(name for name, _ in checkpoint_tensors(file))
            continue
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            names.update(json.loads(f.read(header_len)))
    return names
