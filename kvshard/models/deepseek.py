"""DeepSeek-V2 / V3 decoders (Kimi K2 checkpoints are V3): Multi-head Latent Attention and MoE.

MLA decodes in its absorbed form (docs/design.md#one-decode-step-of-attention; long prefill chunks read
their cached context expanded, docs/mla.md). The cache holds one latent
per token, [c_kv | k_pe], shared by all heads; q_nope is taken into the latent
space through W_UK, so attention scores are q_latent . [c_kv | k_pe] and the
attention output is a latent that W_UV takes back to each head. The latent is a
single "KV head" that every rank's attention reads whole.

Read top to bottom: projections -> attention -> MLP and MoE -> decoder layer ->
model -> causal LM. Shapes: t = tokens in the step, D = hidden size, H_q = heads
whose query this rank computes, H_o = heads whose output it keeps (its share of the
output projection's input), c = kv_lora_rank, r = qk_rope_head_dim,
n = qk_nope_head_dim, v = v_head_dim.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from kvshard import envs
from kvshard.attention.backend import Attention, ExpandedContext
from kvshard.compilation import call_opaque
from kvshard.forward_context import get_forward_context
from kvshard.models.causal_lm import CausalLM, PreNormDecoderLayer
from kvshard.layers.activation import silu_and_mul
from kvshard.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvshard.layers.linear import (
    HeadParallelLinear, MergedColumnParallelLinear, PartialRowParallelLinear, ReplicatedLinear, RowParallelLinear,
)
from kvshard.layers.moe import FusedMoE, Routing, TopKRouter
from kvshard.layers.norm import RMSNorm
from kvshard.layers.rotary import RotaryEmbedding, apply_rotary
from kvshard.parallel import ParallelState, tp_all_reduce

# DeepSeek's q_a_layernorm and kv_a_layernorm keep the default epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg) -> float:
    """1/sqrt(n + r), the head dim before absorption, times YaRN's mscale^2 where the config asks for it."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class LatentUpProjection(nn.Module):
    """kv_b_proj [H*(n+v), c], kept in the two pieces the absorbed form uses.

    One parameter: W_UK [H_q, n, c] then W_UV [H_q, v, c], for every head whose query this rank
    computes (the heads whose output it keeps are among them; the others' W_UV expands the cached
    context of long chunks, `expand_kv` with `all_query_heads`).
    """

    def __init__(self, cfg, q_heads: range, own_heads: range, dtype: torch.dtype) -> None:
        super().__init__()
        if not (q_heads.start <= own_heads.start and own_heads.stop <= q_heads.stop):
            raise ValueError(f"output heads {own_heads} are not among the query heads {q_heads}")
        self.num_heads = cfg.num_attention_heads
        self.q_heads, self.own_heads = q_heads, own_heads
        self.nope_dim, self.v_dim, self.latent_dim = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        rows = len(q_heads) * (self.nope_dim + self.v_dim)
        self.weight = nn.Parameter(torch.empty(rows, self.latent_dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.own = _relative(own_heads, q_heads)  # the kept heads among the query heads

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.nope_dim
        per_head = loaded.view(self.num_heads, n + self.v_dim, self.latent_dim)[self.q_heads.start : self.q_heads.stop]
        param.data.copy_(torch.cat([per_head[:, :n].flatten(0, 1), per_head[:, n:].flatten(0, 1)]))

    def _w_uk(self) -> torch.Tensor:  # [H_q, n, c]
        return self.weight[: len(self.q_heads) * self.nope_dim].view(len(self.q_heads), self.nope_dim, self.latent_dim)

    def _w_uv(self) -> torch.Tensor:  # [H_q, v, c]
        return self.weight[len(self.q_heads) * self.nope_dim :].view(len(self.q_heads), self.v_dim, self.latent_dim)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[t, H_q, n] -> [t, H_q, c]: q_nope . (W_UK c_kv) == (q_nope W_UK) . c_kv."""
        return torch.einsum("thn,hnc->thc", q_nope, self._w_uk())

    def expand_kv(self, c_kv: torch.Tensor, all_query_heads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """[t, c] -> per-head keys [t, H, n] and values [t, H, v] of the heads whose output it keeps (H_o),
        or with `all_query_heads` of every head whose query it computes (H_q)."""
        if all_query_heads:  # one product with the whole parameter: [t, H_q * n | H_q * v]
            both = torch.nn.functional.linear(c_kv, self.weight)
            split = len(self.q_heads) * self.nope_dim
            return both[:, :split].unflatten(1, (-1, self.nope_dim)), both[:, split:].unflatten(1, (-1, self.v_dim))
        return (torch.einsum("tc,hnc->thn", c_kv, self._w_uk()[self.own]),
                torch.einsum("tc,hvc->thv", c_kv, self._w_uv()[self.own]))

    def expand_output(self, latent: torch.Tensor) -> torch.Tensor:
        """[t, H_o, c] -> [t, H_o, v]: the attention-weighted latent through each head's W_UV."""
        return torch.einsum("thc,hvc->thv", latent, self._w_uv()[self.own])

    def expanded_min_rows(self) -> int:
        """The rows from which a chunk reads its cached context cheaper expanded than absorbed.

        Per (row, cached token, head) the absorbed form takes c + r multiply-adds for the score and c for the
        value, the expanded one n + r and v; expanding costs c (n + v) per (cached token, head), once per chunk:
        level in products at c (n + v) / (2c - n - v) rows (43 in the MLA demo, 171 in DeepSeek-V3's dims). The
        absorbed kernel runs its products faster (every head of a row reads one latent), so on the AVX-512 CPU of
        BENCHMARKS.md section 21 one layer's two forms were level at 1.75-2.1x that in the demo's dims and 1.45-1.5x
        in DeepSeek-V3's (16 heads, float32 and bfloat16): the bound is 1.75x the products' break-even (75 rows in
        the demo, 299 in DeepSeek-V3's dims), where either error costs a few percent of the chunk's attention.
        KVSHARD_MLA_EXPANDED_MIN_ROWS overrides."""
        return expanded_min_rows(self.latent_dim, self.nope_dim, self.v_dim)


def expanded_min_rows(c: int, n: int, v: int) -> int:
    """LatentUpProjection.expanded_min_rows for a latent of c channels, n + r-channel keys, v-channel values."""
    override = envs.get("KVSHARD_MLA_EXPANDED_MIN_ROWS")
    if override is not None:
        return override
    saved = 2 * c - n - v
    return -(-7 * c * (n + v) // (4 * saved)) if saved > 0 else 1 << 40


def describe_cached_context(cfg, batch_invariant: bool) -> str:
    """One line of the start-up report: how an MLA model's steps read their cached latents."""
    if batch_invariant:
        return "MLA cached context: absorbed for every row (the batch-invariant mode)"
    rows = expanded_min_rows(cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim)
    return (f"MLA cached context: absorbed for decodes and chunks under {rows:,} rows, expanded (per-head keys and "
            f"values up-projected from the latents) for longer chunks (KVSHARD_MLA_EXPANDED_MIN_ROWS)")


class DeepseekV2MLAAttention(nn.Module):
    def __init__(self, cfg, cache_index: int, rope_interleaved: bool, dtype: torch.dtype,
                 parallel: ParallelState) -> None:
        super().__init__()
        self.cache_index = cache_index  # its cache among the forward context's
        self.latent_dim, self.rope_dim = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_interleaved = rope_interleaved
        self.q_lora = cfg.q_lora_rank is not None
        heads = parallel.attention_heads(cfg.num_attention_heads, 1)  # one latent for all heads
        q_heads, own_heads = heads.query, heads.output
        self.num_q_heads = len(q_heads)
        qk_head_dim = self.nope_dim + self.rope_dim
        bias = bool(cfg.attention_bias)
        if self.q_lora:  # Q through its own low-rank bottleneck (V3, V2 full size)
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = HeadParallelLinear(cfg.q_lora_rank, qk_head_dim, q_heads, dtype)
        else:
            self.q_proj = HeadParallelLinear(cfg.hidden_size, qk_head_dim, q_heads, dtype)
        # the latent is shared by all heads: every rank computes it whole
        self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, self.latent_dim + self.rope_dim, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = LatentUpProjection(cfg, q_heads, own_heads, dtype)
        self._expanded_min_rows = self.kv_b_proj.expanded_min_rows()
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.v_head_dim, cfg.hidden_size, bias, dtype, parallel)
        self.attn = Attention(heads, softmax_scale(cfg), parallel)

    def forward(self, x, cos, sin) -> torch.Tensor:
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # [t, H_q*(n+r)]
        else:
            q = self.q_proj(x)  # [t, H_q*(n+r)]
        q_nope, q_pe = q.unflatten(-1, (self.num_q_heads, -1)).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent_dim, self.rope_dim], dim=-1)  # [t, c], [t, r]
        c_kv = self.kv_a_layernorm(c_kv)  # cached normalised: the norm is part of the key and value
        q_pe = apply_rotary(q_pe, cos, sin, self.rope_interleaved)  # [t, H_q, r]
        k_pe = apply_rotary(k_pe.unsqueeze(1), cos, sin, self.rope_interleaved)  # [t, 1, r], cached rotated
        o = call_opaque(torch.ops.kvshard.mla_attention, self, q_nope, q_pe, c_kv, k_pe,
                        width=self.o_proj.in_per_rank)  # [t, H_o*v]
        return self.o_proj(o)  # [t, D]

    def opaque_forward(self, q_nope, q_pe, c_kv, k_pe) -> torch.Tensor:
        """Attention over the step's cache from q_nope [t, H_q, n], q_pe [t, H_q, r] (rotated), c_kv [t, c]
        (normalised) and k_pe [t, 1, r] (rotated): [t, H_o*v] (outside a compiled graph: kvshard/compilation.py)."""
        context = get_forward_context()
        meta, cache = context.meta, context.caches[self.cache_index]
        rows = meta.context_rows  # only they attend to the cached latents: the others need no absorbed query
        q_latent = torch.cat([self.kv_b_proj.absorb_query(q_nope[:rows]), q_pe[:rows]], dim=-1)  # [rows, H_q, c+r]
        latent_kv = torch.cat([c_kv.unsqueeze(1), k_pe], dim=-1)  # [t, 1, c+r]: what the cache stores
        chunk = None
        if meta.has_prefill:
            if cache.rounds:  # the chunk's own latents as the cache holds them (FP8), as later steps read them
                stored, _ = cache.as_read(latent_kv)
                c_kv, k_pe = stored.squeeze(1)[:, : self.latent_dim], stored[..., self.latent_dim :]
            chunk = self._chunk_attention_inputs(q_nope, q_pe, c_kv, k_pe)
        expanded = self._expanded_context(q_nope, q_pe) if meta.has_prefill and rows else None
        return self.attn.forward(
            q_latent, latent_kv, latent_kv[..., : self.latent_dim], cache, meta,
            value_map=self.kv_b_proj.expand_output, chunk=chunk, expanded=expanded,
        )  # [t, H_o*v]

    def _expanded_context(self, q_nope, q_pe) -> ExpandedContext:
        """How a long chunk reads its cached context in the expanded form (Attention.forward): queries per head,
        the cached latents [L, c + r] up-projected into keys [L, H_q, n + r] and values [L, H_q, v]."""
        up = self.kv_b_proj

        def queries(rows: slice) -> torch.Tensor:
            return torch.cat([q_nope[rows], q_pe[rows]], dim=-1)

        def keys_values(latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            c_kv, k_pe = latents.split([self.latent_dim, self.rope_dim], dim=-1)
            k_nope, v = up.expand_kv(c_kv, all_query_heads=True)
            return torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, k_nope.shape[1], -1)], dim=-1), v

        return ExpandedContext(self._expanded_min_rows, up.v_dim, queries, keys_values)

    def _chunk_attention_inputs(self, q_nope, q_pe, c_kv, k_pe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A prefill chunk attends to itself in the expanded form: keys of n + r and values of v
        channels per head, against c + r channels both ways in the absorbed form (the same scores:
        q_nope . (W_UK c) == (q_nope W_UK) . c). Many queries against as many keys pay for channels,
        so the smaller form is used there; cached context is read absorbed (the cache holds latents), except by
        long chunks (`_expanded_context`)."""
        own = self.kv_b_proj.own  # the kept heads among the queries
        q_nope, q_pe = q_nope[:, own], q_pe[:, own]
        k_nope, v = self.kv_b_proj.expand_kv(c_kv)  # [t, H_o, n], [t, H_o, v]
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1)], dim=-1)
        return q, k, v


def _relative(inner: range, outer: range) -> slice:
    return slice(inner.start - outer.start, inner.stop - outer.start)


class DeepseekV2MLP(nn.Module):
    """SwiGLU MLP split over TP by its intermediate dim. As shared experts it leaves the
    all-reduce to the MoE block (reduce_results=False)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, parallel: ParallelState,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], False, dtype, parallel
        )
        if reduce_results:
            self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, dtype, parallel)
        else:
            self.down_proj = PartialRowParallelLinear(intermediate_size, hidden_size, dtype, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DeepseekV2MoE(nn.Module):
    def __init__(self, cfg, routing: Routing, dtype: torch.dtype, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.gate = TopKRouter(cfg.hidden_size, cfg.n_routed_experts, routing)
        self.experts = FusedMoE(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, parallel)
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = DeepseekV2MLP(
                cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype, parallel, reduce_results=False
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)  # [t, k], [t, k]
        # [t, D]: this rank's experts, picked on the host (outside a compiled graph)
        partial = call_opaque(torch.ops.kvshard.moe_experts, self.experts, x, topk_weights, topk_ids, width=x.shape[-1])
        if self.shared_experts is not None:
            partial = partial + self.shared_experts(x)  # [t, D]: this rank's slice of the shared experts
        return tp_all_reduce(partial, self.parallel)  # one all-reduce for both


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    def __init__(
        self, cfg, layer_index: int, rope_interleaved: bool, routing: Routing | None, dtype: torch.dtype,
        parallel: ParallelState, cache_index: int | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # its cache: the layer's own, or (the MTP layer, numbered after the target's) the one given
        self.self_attn = DeepseekV2MLAAttention(cfg, layer_index if cache_index is None else cache_index,
                                                rope_interleaved, dtype, parallel)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # the first first_k_dense_replace layers are dense, the rest MoE
        if routing is not None and layer_index >= cfg.first_k_dense_replace:
            self.mlp = DeepseekV2MoE(cfg, routing, dtype, parallel)
        else:
            self.mlp = DeepseekV2MLP(cfg.hidden_size, cfg.intermediate_size, dtype, parallel)


class DeepseekV2Model(nn.Module):
    def __init__(
        self, cfg, rope_interleaved: bool, routing: Routing | None, dtype: torch.dtype, parallel: ParallelState,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, parallel)
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(cfg, i, rope_interleaved, routing, dtype, parallel)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


# checkpoint name -> (our fused parameter, shard): dense and shared-expert gate/up in one matmul
PACKED_MODULES = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# a routed expert's projection, after PACKED_MODULES has renamed gate/up
_EXPERT_WEIGHT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_up_proj|down_proj)\.weight")


def _stacked_expert_name(name: str, shard_id) -> tuple[str, object]:
    """A routed expert's per-expert tensor -> its layer's stacked parameter and (expert, shard)."""
    expert = _EXPERT_WEIGHT.fullmatch(name)
    if expert is None:
        return name, shard_id
    experts, index, projection = expert.groups()
    if projection == "down_proj":
        return f"{experts}.w2_weight", (int(index), None)
    return f"{experts}.w13_weight", (int(index), shard_id)


class DeepseekV2ForCausalLM(CausalLM):
    packed_modules = PACKED_MODULES
    _layer_index = re.compile(r"model\.layers\.(\d+)\.")

    def __init__(self, cfg, dtype: torch.dtype, parallel: ParallelState) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported; kvshard's DeepSeek MLPs use silu")
        if getattr(cfg, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported for DeepSeek models")
        self.cfg = cfg
        has_moe = bool(cfg.n_routed_experts) and cfg.first_k_dense_replace < cfg.num_hidden_layers
        routing = self.routing(cfg) if has_moe else None
        self.model = DeepseekV2Model(cfg, self.rope_interleaved(cfg), routing, dtype, parallel)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, parallel)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg, cfg.qk_rope_head_dim)

    @staticmethod
    def rope_interleaved(cfg) -> bool:
        return True  # V2 rotates adjacent pairs (its complex-number RoPE)

    @staticmethod
    def routing(cfg) -> Routing:
        # transformers' DeepSeek-V2 never renormalises the top-k weights (published V2
        # checkpoints set norm_topk_prob false), so neither does kvshard.
        return Routing(
            top_k=cfg.num_experts_per_tok, method=cfg.topk_method, num_groups=cfg.n_group or 1,
            topk_groups=cfg.topk_group or 1, norm_topk_prob=False, routed_scaling_factor=cfg.routed_scaling_factor,
        )

    def remap_weight_name(self, name: str, shard_id) -> tuple[str | None, object]:
        """Routed experts' per-expert tensors go into their layer's stacked parameters;
        layers past num_hidden_layers (V3's multi-token-prediction module) are not used."""
        layer = self._layer_index.match(name)
        if layer is not None and int(layer.group(1)) >= self.cfg.num_hidden_layers:
            return None, None
        return _stacked_expert_name(name, shard_id)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @staticmethod
    def rope_interleaved(cfg) -> bool:
        return bool(getattr(cfg, "rope_interleave", True))

    @staticmethod
    def routing(cfg) -> Routing:
        return Routing(
            top_k=cfg.num_experts_per_tok, method="noaux_tc", num_groups=cfg.n_group or 1,
            topk_groups=cfg.topk_group or 1, norm_topk_prob=bool(cfg.norm_topk_prob),
            routed_scaling_factor=cfg.routed_scaling_factor,
        )


class DeepseekMultiTokenPredictor(nn.Module):
    """V3's multi-token-prediction (MTP) module, the speculative drafter of `{"method": "mtp"}`.

    Published checkpoints store it as layer L = num_hidden_layers: `embed_tokens` (a copy of the
    main embedding), the RMSNorms `enorm` and `hnorm`, `eh_proj` [D, 2D], one decoder layer (MoE
    from first_k_dense_replace on, as V3's) and `shared_head.{norm,head}` (a copy of the final norm
    and LM head). For the token at position p + 2 it takes the target's last-layer hidden state at
    p (before the final norm) and the embedding of token p + 1; its decoder layer attends over its
    own one-layer cache, whose entry at p holds that pair (RoPE position p). Only the first MTP
    layer is used: further drafts apply it again to its own output hidden state.
    """

    packed_modules = PACKED_MODULES

    def __init__(self, cfg, dtype: torch.dtype, parallel: ParallelState) -> None:
        super().__init__()
        self.prefix = f"model.layers.{cfg.num_hidden_layers}."
        d = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, d, dtype, parallel)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * d, d, False, dtype)  # its input is replicated over TP: no collective
        routing = DeepseekV3ForCausalLM.routing(cfg) if cfg.n_routed_experts else None
        self.layer = DeepseekV2DecoderLayer(cfg, cfg.num_hidden_layers, DeepseekV3ForCausalLM.rope_interleaved(cfg),
                                            routing, dtype, parallel, cache_index=0)  # its one-layer cache
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.shared_head.head = ParallelLMHead(cfg.vocab_size, d, dtype, parallel)
        self.rotary = RotaryEmbedding(cfg, cfg.qk_rope_head_dim)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens p + 1 [t] and hidden states at p [t, D] at positions p [t] -> its output [t, D], before
        shared_head.norm: the hidden state the next draft starts from (its cache: the forward context's)."""
        cos, sin = self.rotary.cos_sin(positions)
        x = torch.cat([self.enorm(self.embed_tokens(input_ids)), self.hnorm(hidden)], dim=-1)  # [t, 2D]
        return self.layer(self.eh_proj(x), cos, sin)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[t, D] -> float32 logits [t, V] on rank 0, None on the other ranks."""
        return self.shared_head.head.logits(self.shared_head.norm(hidden))

    def remap_weight_name(self, name: str, shard_id) -> tuple[str | None, object]:
        """Only layer L's tensors, its decoder layer's under `layer.`; the target's are skipped."""
        if not name.startswith(self.prefix):
            return None, None
        name = name[len(self.prefix):]
        if name.startswith(("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")):
            name = f"layer.{name}"
        return _stacked_expert_name(name, shard_id)
