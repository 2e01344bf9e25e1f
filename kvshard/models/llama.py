"""Llama-family decoders with grouped-query attention: Llama, Qwen2 (QKV bias), Qwen3 (per-head RMSNorm of
queries and keys before RoPE), Mistral.

Read top to bottom: attention -> MLP -> decoder layer -> model -> causal LM.
Shapes: t = tokens in the step (all requests, flattened), D = hidden size,
H_q / Hk_l = query / KV heads this rank computes, F_l = its share of the attention
output features (the output projection's input slice), d = head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from kvshard.attention.backend import Attention
from kvshard.compilation import call_opaque
from kvshard.forward_context import get_forward_context
from kvshard.kv.cache import head_dim_of
from kvshard.models.causal_lm import CausalLM, PreNormDecoderLayer
from kvshard.layers.activation import silu_and_mul
from kvshard.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvshard.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvshard.layers.norm import RMSNorm
from kvshard.layers.rotary import RotaryEmbedding, apply_rotary
from kvshard.parallel import ParallelState


class LlamaAttention(nn.Module):
    def __init__(self, cfg, layer_index: int, qkv_bias: bool, o_bias: bool, dtype: torch.dtype,
                 parallel: ParallelState, qk_norm: bool = False) -> None:
        super().__init__()
        self.layer_index = layer_index  # its cache among the forward context's
        d = head_dim_of(cfg)
        heads = parallel.attention_heads(cfg.num_attention_heads, cfg.num_key_value_heads)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, heads.query, heads.kv, qkv_bias, dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, o_bias, dtype, parallel)
        self.attn = Attention(heads, d**-0.5, parallel)
        self.qk_norm = qk_norm
        if qk_norm:  # one weight [d] shared by every head
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)

    def forward(self, x, cos, sin) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # [t, H_q, d], [t, Hk_l, d], [t, Hk_l, d]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = call_opaque(torch.ops.kvshard.attention, self, q, k, v, width=self.o_proj.in_per_rank)  # [t, F_l]
        return self.o_proj(o)  # [t, D]

    def opaque_forward(self, q, k, v) -> torch.Tensor:
        """Attention over the step's cache (outside a compiled graph: kvshard/compilation.py)."""
        context = get_forward_context()
        return self.attn.forward(q, k, v, context.caches[self.layer_index], context.meta)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, parallel: ParallelState,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias, dtype, parallel
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, dtype, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg, layer_index: int, qkv_bias: bool, o_bias: bool, dtype: torch.dtype,
                 parallel: ParallelState, qk_norm: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, layer_index, qkv_bias, o_bias, dtype, parallel, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, dtype, parallel, mlp_bias)


class LlamaModel(nn.Module):
    def __init__(self, cfg, qkv_bias: bool, o_bias: bool, dtype: torch.dtype, parallel: ParallelState,
                 qk_norm: bool = False) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, parallel)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, qkv_bias, o_bias, dtype, parallel, qk_norm) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LlamaForCausalLM(CausalLM):
    # checkpoint name -> (our fused parameter, shard) for projections stored as one matmul
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False  # Qwen3's per-head RMSNorm of queries and keys

    def __init__(self, cfg, dtype: torch.dtype, parallel: ParallelState) -> None:
        super().__init__()
        qkv_bias, o_bias = self.attention_biases(cfg)
        self.cfg = cfg
        self.model = LlamaModel(cfg, qkv_bias, o_bias, dtype, parallel, self.qk_norm)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, parallel)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg, head_dim_of(cfg))

    @staticmethod
    def attention_biases(cfg) -> tuple[bool, bool]:
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(cfg) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class MistralForCausalLM(LlamaForCausalLM):
    pass
