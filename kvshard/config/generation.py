"""The sampling defaults a model's generation_config.json recommends (`--generation-config`), and the model's
context length as the engine derives it under RoPE scaling (`--max-model-len`'s default and its check).

`--generation-config auto` (the default): the model directory's generation_config.json sets the defaults of
temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as `max_tokens`) for every request that
does not give them; `vllm`: kvshard's own defaults only; a folder: its generation_config.json instead.
`--override-generation-config '{"temperature": 0.5}'` sets some over either. A value a request could not give
(a negative temperature) fails at start-up, naming the file and the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvshard.errors import ConfigError

AUTO, OWN = "auto", "vllm"  # --generation-config's two names; anything else is a folder
# generation_config.json's fields that set sampling defaults, and the SamplingParams field each sets
SAMPLING_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                   "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    """What requests that leave a sampling field out get instead of kvshard's own default.

    `values`: SamplingParams field -> value (`max_tokens` included: it also caps what a request asks for, as
    vLLM's server-wide limit from max_new_tokens); `source`: where they came from, for the start-up report."""

    values: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    setting: str = AUTO

    def describe(self) -> str:
        """The start-up report's line: which of kvshard's defaults the model's generation config overrode."""
        if self.values:
            shown = ", ".join(f"{k}={v!r}" for k, v in self.values.items())
            cap = " (max_tokens also caps what a request asks for)" if "max_tokens" in self.values else ""
            keep = "" if self.setting == OWN else "; --generation-config vllm keeps kvshard's own"
            return (f"sampling defaults: {shown} from {self.source}, for requests that do not give them{cap}{keep}")
        if self.setting == OWN:
            return "sampling defaults: kvshard's own (--generation-config vllm)"
        return f"sampling defaults: kvshard's own ({self.source})"


def load_generation_defaults(model_path: Path, setting: str = AUTO,
                             override: str | dict | None = None) -> GenerationDefaults:
    """`--generation-config` (auto, vllm or a folder) and `--override-generation-config` read and checked."""
    if not isinstance(setting, str) or not setting.strip():
        raise ConfigError(f"generation_config={setting!r}: use auto, vllm or a folder holding generation_config.json")
    values: dict[str, Any] = {}
    source = "no generation_config.json in the model directory"
    if setting != OWN:
        if setting == AUTO:
            file = Path(model_path) / "generation_config.json"
        else:
            folder = Path(setting).expanduser()
            if not folder.is_dir():
                raise ConfigError(f"--generation-config {setting!r} is not a folder: use auto (the model's "
                                  "generation_config.json), vllm (kvshard's own defaults) or a folder holding one")
            file = folder / "generation_config.json"
            if not file.is_file():
                raise ConfigError(f"--generation-config {setting!r}: the folder holds no generation_config.json")
        if file.is_file():
            source = str(file)
            raw = _read_json_object(file)
            values = _checked(raw, lambda name: f"{file}: {name}")
            if not values:
                source = "the model's generation_config.json sets none" if setting == AUTO else f"{file} sets none"
    if override is not None:
        raw = override
        if isinstance(override, str):
            try:
                raw = json.loads(override)
            except ValueError as error:
                raise ConfigError(f"--override-generation-config is not valid JSON ({error})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"--override-generation-config must be a JSON object, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(SAMPLING_FIELDS))
        if unknown:
            raise ConfigError(f"--override-generation-config: {unknown[0]} is not a sampling default kvshard takes "
                              f"from a generation config ({', '.join(SAMPLING_FIELDS)})")
        given = _checked(raw, lambda name: f"--override-generation-config: {name}")
        if given:
            values.update(given)
            source = (f"{source} and --override-generation-config" if source.endswith(".json") and values != given
                      else "--override-generation-config")
    return GenerationDefaults(values, source, setting)


def _read_json_object(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text())
    except (UnicodeDecodeError, ValueError) as error:
        raise ConfigError(f"{file} cannot be read ({error}); fix it, or start with --generation-config vllm") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file} holds {type(raw).__name__}, not a JSON object; fix it, or start with "
                          "--generation-config vllm")
    return raw


def _checked(raw: dict, where) -> dict[str, Any]:
    """The sampling fields of `raw` that are set (not null), each checked as a request's value would be."""
    from kvshard.sampling_params import SamplingParams

    values = {}
    for name, target in SAMPLING_FIELDS.items():
        value = raw.get(name)
        if value is None:
            continue
        try:
            SamplingParams(**{target: value})
        except (ValueError, TypeError) as error:
            reason = str(error).split(", got")[0].removeprefix(target).strip()
            raise ConfigError(f"{where(name)}={value!r}: {name} {reason}; fix the value, or start with "
                              "--generation-config vllm for kvshard's own defaults") from None
        values[target] = value
    return values


# --- the context length -------------------------------------------------------------------------------------------

# RoPE types whose frequencies are fixed (the same at every length): positions beyond max_position_embeddings
# are computed as transformers computes them, so the context extends by the factor, as vLLM derives it
_EXTENDING = ("linear", "yarn")
# types vLLM does not extend by the factor: their max_position_embeddings is already the extended length
_NOT_EXTENDING = ("default", "llama3", "longrope", "su")


@dataclass(frozen=True)
class ContextLength:
    tokens: int
    why: str  # how the model's config gives it, for the report and errors


def model_context_length(model_config) -> ContextLength:
    """The longest sequence the model computes as transformers does: max_position_embeddings, times the RoPE
    scaling factor for linear and yarn (yarn's over original_max_position_embeddings when given)."""
    max_pos = model_config.max_position_embeddings
    rope = dict(getattr(model_config.hf_config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    factor = rope.get("factor")
    if rope_type in _EXTENDING and isinstance(factor, (int, float)) and factor > 0:
        if rope_type == "yarn" and rope.get("original_max_position_embeddings"):
            base, base_name = rope["original_max_position_embeddings"], "original_max_position_embeddings"
        else:
            base, base_name = max_pos, "max_position_embeddings"
        return ContextLength(int(base * factor), f"{base_name} {base:,} x {rope_type} RoPE factor {factor:g}")
    why = f"max_position_embeddings {max_pos:,}"
    if rope_type == "dynamic" and isinstance(factor, (int, float)) and factor > 1:
        why += (f"; dynamic RoPE scaling is not extended by its factor {factor:g}: beyond max_position_embeddings "
                "transformers changes the frequencies with the sequence's length, which keys already cached "
                "cannot follow")
    elif rope_type not in _NOT_EXTENDING and rope_type != "dynamic":
        why += f" ({rope_type} RoPE)"
    return ContextLength(max_pos, why)


AUTO_LENGTH = -1  # --max-model-len auto (or -1): the longest the model and the KV cache allow
_SUFFIX = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_length(value: str | int) -> int:
    """`--max-model-len` as vLLM reads it: 32k = 32,000, 32K = 32,768, 25.6k = 25,600, a plain integer, or
    auto / -1 (the longest that fits); anything else a ConfigError saying what to write."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"max_model_len={value!r} must be a number of tokens, e.g. 4096, 32k or 32K")
    text = value.strip()
    if text == "-1" or text.lower() == "auto":
        return AUTO_LENGTH
    match = _SUFFIX.fullmatch(text)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise ConfigError(f"max_model_len={value!r}: a binary suffix ({suffix} = {_BINARY[suffix]:,}) takes a "
                              f"whole number; did you mean {number}{suffix.lower()}?")
        return int(number) * _BINARY[suffix]
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"max_model_len={value!r} is not a number of tokens: write e.g. 4096, 32k (32,000), "
                          "32K (32,768) or auto") from None


def cli_length(value: str) -> int | str:
    """argparse's type for --max-model-len: the tokens, or the text as given where it is not a length, for
    EngineArgs to refuse in one line (not argparse's usage message)."""
    try:
        return parse_length(value)
    except ConfigError:
        return value
