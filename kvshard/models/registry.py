"""Which Hugging Face architectures kvshard runs, and how a `model` argument becomes a directory."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from torch import nn

# architecture name in config.json -> "module:Class"
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "kvshard.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "kvshard.models.llama:Qwen2ForCausalLM",
    "MistralForCausalLM": "kvshard.models.llama:MistralForCausalLM",
    "DeepseekV2ForCausalLM": "kvshard.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "kvshard.models.deepseek:DeepseekV3ForCausalLM",  # also Kimi K2
}
# one latent "KV head" per token (Multi-head Latent Attention)
MLA_ARCHITECTURES: set[str] = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"}


def model_class(architecture: str) -> type[nn.Module]:
    module, name = SUPPORTED_ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module), name)


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A directory on disk, or the name of a built-in demo model (created on first use)."""
    from kvshard.config import ConfigError
    from kvshard.models.demo import DEMO_MODELS, ensure_demo_model
    from kvshard.models.gguf import resolve_gguf

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
