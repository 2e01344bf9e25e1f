"""Finding and checking a model directory: a local checkpoint, a built-in demo model or a GGUF file, its
config.json, weights and tokenizer files, read into a `ModelConfig` before any rank starts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from kvshard.config.model import ModelConfig
from kvshard.config.parsing import resolve_dtype
from kvshard.errors import ConfigError
from kvshard.models.demo import DEMO_MODELS, ensure_demo_model
from kvshard.models.gguf import resolve_gguf
from kvshard.models.loader import check_checkpoint_files, check_vocab_size, checkpoint_files
from kvshard.models.quantization import parse_quantization_config
from kvshard.models.registry import MLA_ARCHITECTURES, SUPPORTED_ARCHITECTURES


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A directory on disk, or the name of a built-in demo model (created on first use)."""
    if str(model) in DEMO_MODELS:
        return ensure_demo_model(str(model))
    if (converted := resolve_gguf(model)) is not None:
        return converted
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(
            f"model {str(model)!r} is neither a directory nor a built-in demo model "
            f"({', '.join(DEMO_MODELS)}); kvshard never downloads weights: pass a local checkpoint directory"
        )
    if not path.is_dir():
        raise ConfigError(f"model {str(model)!r} is a file; pass the checkpoint directory that holds config.json")
    return path.resolve()


def load_model_config(model: str | os.PathLike, dtype: str | torch.dtype = "auto") -> ModelConfig:
    path = resolve_model_path(model)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model directory {path} has no config.json: point --model at a Hugging Face checkpoint directory")
    try:
        raw = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{config_file} is not valid JSON ({error}); the checkpoint is corrupt or incomplete") \
            from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_file} holds {type(raw).__name__}, not a JSON object; the checkpoint is corrupt")
    architectures = raw.get("architectures") or []
    supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ConfigError(
            f"model at {path} has architecture {architectures or 'unknown'}, which kvshard does not support; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    quantization = parse_quantization_config(raw.get("quantization_config"), config_file)
    if not checkpoint_files(path):
        raise ConfigError(f"model directory {path} has no weights: kvshard reads *.safetensors or pytorch_model*.bin "
                          "files; point the model at the checkpoint directory that holds them")
    shapes = check_checkpoint_files(path)
    check_config_values(config_file, raw)
    check_supported_features(config_file, raw, supported[0])
    check_tokenizer_files(path)

    hf_config = _load_hf_config(path, raw, supported[0])
    check_vocab_size(config_file, hf_config.vocab_size, shapes)
    add_generation_eos(path, hf_config)
    checkpoint_dtype = raw.get("dtype") or raw.get("torch_dtype")
    architecture = supported[0]
    return ModelConfig(
        path=path,
        architecture=architecture,
        hf_config=hf_config,
        dtype=resolve_dtype(dtype, checkpoint_dtype),
        max_position_embeddings=hf_config.max_position_embeddings,
        is_mla=architecture in MLA_ARCHITECTURES,
        quantization=quantization,
    )


# config.json fields kvshard reads, by what they must hold (null: not used)
_POSITIVE_INT_FIELDS = (
    "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "vocab_size", "max_position_embeddings", "head_dim", "moe_intermediate_size", "n_routed_experts",
    "num_experts_per_tok", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "sliding_window", "n_group", "topk_group",
)
_NON_NEGATIVE_INT_FIELDS = ("first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers")
_POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")


def check_config_values(config_file: Path, raw: dict) -> None:
    """Every size in config.json an integer in range, every epsilon a positive number: a ConfigError naming
    the file and the field, instead of a traceback from the middle of building a model."""
    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for name in (*_POSITIVE_INT_FIELDS, *_NON_NEGATIVE_INT_FIELDS):
        value = raw.get(name)
        least = 1 if name in _POSITIVE_INT_FIELDS else 0
        if value is not None and not (is_int(value) and value >= least):
            what = "a positive integer" if least else "an integer >= 0"
            raise ConfigError(f"{config_file}: {name}={value!r} must be {what}; the checkpoint's config is invalid")
    for name in _POSITIVE_FLOAT_FIELDS:
        value = raw.get(name)
        if value is not None and not ((is_int(value) or isinstance(value, float)) and 0 < value < float("inf")):
            raise ConfigError(f"{config_file}: {name}={value!r} must be a positive number; "
                              "the checkpoint's config is invalid")


def check_supported_features(config_file: Path, raw: dict, architecture: str) -> None:
    """Settings of config.json that change what the model computes but that kvshard's models do not implement:
    a ConfigError naming the field, rather than a model that runs and computes something else."""
    def refuse(name: str, value: Any, supported: str) -> None:
        raise ConfigError(f"{config_file}: {name}={value!r} is not supported by kvshard's {architecture} ({supported})")

    if raw.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", raw["hidden_act"], "its MLPs use silu")
    if architecture in MLA_ARCHITECTURES:
        if raw.get("moe_layer_freq", 1) != 1:
            refuse("moe_layer_freq", raw["moe_layer_freq"], "every layer from first_k_dense_replace on is MoE: 1")
        if raw.get("mlp_bias"):
            refuse("mlp_bias", raw["mlp_bias"], "its MLPs have no bias")
        v3 = architecture == "DeepseekV3ForCausalLM"
        scoring = raw.get("scoring_func")
        if scoring is not None and scoring != ("sigmoid" if v3 else "softmax"):
            refuse("scoring_func", scoring, "V3 routes by sigmoid scores, V2 by softmax")
        method = raw.get("topk_method")
        if v3 and method is not None and method != "noaux_tc":
            refuse("topk_method", method, "V3 routes with noaux_tc")


def add_generation_eos(path: Path, hf_config) -> None:
    """generation_config.json's eos_token_id (one id or a list: Llama 3's instruct models end a turn with
    <|eot_id|>, which config.json does not name) joins config.json's, as vLLM stops on both."""
    settings = path / "generation_config.json"
    if not settings.is_file():
        return
    try:
        generation = json.loads(settings.read_text())
    except (UnicodeDecodeError, ValueError) as error:
        raise ConfigError(f"{settings} cannot be read ({error}); the checkpoint is corrupt") from None
    eos = generation.get("eos_token_id") if isinstance(generation, dict) else None
    if eos is None:
        return
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < hf_config.vocab_size for i in ids):
        raise ConfigError(f"{settings}: eos_token_id={eos!r} must be a token id or a list of token ids below "
                          f"vocab_size={hf_config.vocab_size}; the checkpoint's generation config is invalid")
    own = hf_config.eos_token_id
    own = own if isinstance(own, list) else [] if own is None else [own]
    merged = own + [i for i in ids if i not in own]
    if merged != own:
        hf_config.eos_token_id = merged


def check_tokenizer_files(path: Path) -> None:
    """tokenizer.json and tokenizer_config.json readable, before any rank starts: a ConfigError naming the file."""
    settings = path / "tokenizer_config.json"
    if settings.is_file():
        try:
            if not isinstance(json.loads(settings.read_text()), dict):
                raise ValueError("not a JSON object")
        except (UnicodeDecodeError, ValueError) as error:
            raise ConfigError(f"{settings} cannot be read ({error}); the checkpoint's tokenizer is corrupt") from None
    vocabulary = path / "tokenizer.json"
    if vocabulary.is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(vocabulary))
        except Exception as error:  # tokenizers raises its own Exception subclass
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ConfigError(f"{vocabulary} cannot be loaded as a tokenizer ({reason}); "
                              "the checkpoint's tokenizer is corrupt") from None


def _load_hf_config(path: Path, raw: dict, architecture: str):
    """transformers' config class for the checkpoint, never its remote code.

    Kimi K2 checkpoints name their own `model_type` (served by remote code) but are the
    DeepSeek-V3 architecture: the config of the architecture kvshard runs reads them.
    """
    from transformers import AutoConfig, DeepseekV2Config, DeepseekV3Config

    by_architecture = {"DeepseekV3ForCausalLM": DeepseekV3Config, "DeepseekV2ForCausalLM": DeepseekV2Config}
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except ValueError:
        if architecture not in by_architecture:
            raise ConfigError(f"transformers cannot read {path / 'config.json'} (model_type {raw.get('model_type')!r})") from None
        fields = {k: v for k, v in raw.items() if k not in ("auto_map", "model_type")}
        return by_architecture[architecture](**fields)
    except Exception as error:  # a field of the wrong kind (transformers' strict config validation), say
        reason = " ".join(str(error).split())
