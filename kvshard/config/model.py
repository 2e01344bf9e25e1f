"""`ModelConfig`: what the engine reads of a checkpoint's config.json (sizes, heads, dtype, quantization)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvshard.config.layout_rules import AttentionShape
from kvshard.kv.cache import head_dim_of


def plain_hf_config(hf_config: Any) -> SimpleNamespace:
    """The attributes of a transformers config (and its attribute aliases) without its class."""
    if isinstance(hf_config, SimpleNamespace):
        return hf_config
    values = {**hf_config.to_dict(), **{k: v for k, v in vars(hf_config).items() if not k.startswith("_")}}
    for alias, name in getattr(type(hf_config), "attribute_map", {}).items():
        if name in values:
            values[alias] = values[name]
    return SimpleNamespace(**values)


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    hf_config: Any = field(repr=False)  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_position_embeddings: int
    is_mla: bool
    quantization: Any = None  # models.quantization.Fp8BlockQuantization for FP8 block-scaled weights

    def __getstate__(self) -> dict:
        # Pickled for the spawned ranks: a transformers config would make every rank import transformers
        # (~1.5 s of CPU each) only to read attributes, so a plain copy of them travels instead unless the
        # RoPE type is one whose transformers init function calls the config's methods.
        state = dict(self.__dict__)
        rope = dict(getattr(self.hf_config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") == "default":
            state["hf_config"] = plain_hf_config(self.hf_config)
        return state  # unpickling puts it in the instance's __dict__, past the frozen __setattr__

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def sliding_window(self) -> int | None:
        """The attention window when the checkpoint uses one (Mistral v0.1; Qwen2 only when enabled)."""
        cfg = self.hf_config
        window = getattr(cfg, "sliding_window", None)
        return window if window and getattr(cfg, "use_sliding_window", True) else None

    @property
    def num_kv_heads(self) -> int:
        """KV heads as the cache sees them: MLA has one shared latent."""
        return 1 if self.is_mla else self.hf_config.num_key_value_heads

    @property
    def num_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def attention_shape(self) -> AttentionShape:
        """What the layout rules (config/layout_rules.py) need to know of this model."""
        return AttentionShape(self.num_heads, self.num_kv_heads, self.attention_value_dim, self.is_mla)

    @property
    def attention_value_dim(self) -> int:
        """Features of one head's attention output, the input of the output projection."""
        return self.hf_config.v_head_dim if self.is_mla else head_dim_of(self.hf_config)

    @property
    def routed_experts(self) -> int:
        """The routed experts of a MoE model's MoE layers (DeepSeek's `n_routed_experts`, its layers from
        `first_k_dense_replace` on); 0 for a model without any."""
        cfg = self.hf_config
        routed = getattr(cfg, "n_routed_experts", None) or 0
        return routed if getattr(cfg, "first_k_dense_replace", 0) < cfg.num_hidden_layers else 0

    def head_projection_params(self, query_heads: int, kv_heads: int) -> int:
        """Parameters per layer of the projections a rank splits by head: GQA's Q, K and V for
        `query_heads` and `kv_heads` heads; MLA's Q (or q_b after the shared Q LoRA), W_UK, which
        takes the queries into the latent, and W_UV, which a rank keeps for every head whose query it
        computes (a long chunk's cached context is expanded for them: models/deepseek.py); the latent's
        own projections are whole on every rank."""
        cfg = self.hf_config
        if not self.is_mla:
            return (query_heads + 2 * kv_heads) * head_dim_of(cfg) * cfg.hidden_size
        q_in = cfg.q_lora_rank or cfg.hidden_size
        per_head = (q_in * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
                    + (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank)
        return query_heads * per_head

    def tp_split_sizes(self, expert_parallel: bool = False) -> dict[str, int]:
        """Sizes the MLP / experts split over all T ranks, by what they are (for error messages). The routed
        experts split by their count with expert parallelism (whole experts on each rank), else by their width."""
        cfg = self.hf_config
        routed = self.routed_experts
        has_moe = routed > 0
        sizes = {}
        if not has_moe or getattr(cfg, "first_k_dense_replace", 0) > 0:
            sizes["MLP width (intermediate_size)"] = cfg.intermediate_size
        if has_moe:
            if expert_parallel:
                sizes["routed experts (n_routed_experts)"] = routed
            else:
                sizes["routed experts' width (moe_intermediate_size)"] = cfg.moe_intermediate_size
            if cfg.n_shared_experts:
                sizes["shared-expert width"] = cfg.moe_intermediate_size * cfg.n_shared_experts
        return sizes

