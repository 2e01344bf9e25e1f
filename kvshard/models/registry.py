"""Which Hugging Face architectures kvshard runs, and the class that runs each."""

from __future__ import annotations

import importlib

from torch import nn

# architecture name in config.json -> "module:Class"
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "kvshard.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "kvshard.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "kvshard.models.llama:Qwen3ForCausalLM",
    "MistralForCausalLM": "kvshard.models.llama:MistralForCausalLM",
    "DeepseekV2ForCausalLM": "kvshard.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "kvshard.models.deepseek:DeepseekV3ForCausalLM",  # also Kimi K2
}
# one latent "KV head" per token (Multi-head Latent Attention)
MLA_ARCHITECTURES: set[str] = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"}


def model_class(architecture: str) -> type[nn.Module]:
    module, name = SUPPORTED_ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module), name)
