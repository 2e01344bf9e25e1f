"""What a model is, as far as serving cost goes: read from a Hugging Face config.json.

Only the fields that set memory, bytes moved and FLOPs per decoded token are kept.
Families understood: Llama-like dense GQA models, Qwen3-MoE (GQA + experts), and the
DeepSeek-V2/V3 / Kimi-K2 family (MLA + experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvshard.planner.errors import PlanError

_DTYPE_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
# FP8 checkpoints of the DeepSeek family keep one fp32 scale per 128x128 weight block.
_FP8_BLOCK = 128 * 128


@dataclass(frozen=True)
class Quantization:
    """How the linear weights of a checkpoint are stored.

    dtype: "bf16", "fp8" (W8A8, one fp32 scale per 128x128 block) or "int4" (W4A16,
    one bf16 scale per `group_size` weights). scope: which weights carry that dtype,
    "linear" (every linear layer of the decoder) or "routed_experts" (only those).
    Embeddings, the LM head and routers always stay in bf16.
    """

    dtype: str = "bf16"
    scope: str = "linear"
    group_size: int = 32

    def bytes_per_param(self) -> float:
        if self.dtype == "int4":
            return 0.5 + 2.0 / self.group_size
        if self.dtype == "fp8":
            return 1.0 + 4.0 / _FP8_BLOCK
        return 2.0

    def describe(self) -> str:
        if self.dtype == "bf16":
            return "bf16"
        where = "routed experts" if self.scope == "routed_experts" else "all linear layers"
        detail = f", group {self.group_size}" if self.dtype == "int4" else ""
        return f"{self.dtype} ({where}{detail})"


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the whole model, by the role they play in a decode step."""

    embedding: int
    lm_head: int
    # Attention, split by how a DCP group with replicated projections holds it:
    # query-side projections (GQA q_proj; MLA q_b_proj or q_proj, W_UK and W_UV) and the
    # GQA K/V projections are held per attention-TP shard; the rest (o_proj, MLA
    # q_a / kv_a) stays sharded over all tp ranks.
    attention_query: int
    attention_kv: int
    attention_other: int
    dense_mlp: int
    shared_experts: int
    routed_experts: int
    router: int

    @property
    def attention(self) -> int:
        return self.attention_query + self.attention_kv + self.attention_other

    @property
    def total(self) -> int:
        return (self.embedding + self.lm_head + self.attention + self.dense_mlp
                + self.shared_experts + self.routed_experts + self.router)


@dataclass(frozen=True)
class ModelArch:
    name: str
    attention: str  # "mla" or "gqa"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # 1 for MLA: one latent shared by all heads
    head_dim: int  # GQA head size
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int
    intermediate_size: int
    num_dense_mlp_layers: int
    num_moe_layers: int
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int
    vocab_size: int
    tie_word_embeddings: bool
    quantization: Quantization
    published_total_params_b: float | None = None
    published_active_params_b: float | None = None

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_values_per_token_per_head(self) -> int:
        """Values cached per token, layer and KV head: K and V for GQA, the latent
        [c_kv | k_pe] for MLA (e.g. 512 + 64)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.head_dim

    @property
    def attention_query_dim(self) -> int:
        """Width of one query head as attention sees it (absorbed MLA: the latent
        plus the RoPE part)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def attention_value_dim(self) -> int:
        """Width of one head of attention output (absorbed MLA: in the latent space)."""
        return self.kv_lora_rank if self.is_mla else self.head_dim

    def params_per_expert(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size  # gate, up, down

    def param_counts(self) -> ParamCounts:
        h = self.hidden_size
        if self.is_mla:
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            q_down = h * self.q_lora_rank
            q_up = (self.q_lora_rank if self.q_lora_rank else h) * self.num_heads * qk_head
            w_uk = self.kv_lora_rank * self.num_heads * self.qk_nope_head_dim
            w_uv = self.kv_lora_rank * self.num_heads * self.v_head_dim
            kv_down = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            # W_UV with the query side: a rank keeps it for every head whose query it computes (the engine
            # expands a long chunk's cached context for them)
            query, kv, other = q_up + w_uk + w_uv, 0, q_down + kv_down + self.num_heads * self.v_head_dim * h
        else:
            query = h * self.num_heads * self.head_dim
            kv = 2 * h * self.num_kv_heads * self.head_dim
            other = self.num_heads * self.head_dim * h  # o_proj
        return ParamCounts(
            embedding=self.vocab_size * h,
            lm_head=0 if self.tie_word_embeddings else self.vocab_size * h,
            attention_query=self.num_layers * query,
            attention_kv=self.num_layers * kv,
            attention_other=self.num_layers * other,
            dense_mlp=self.num_dense_mlp_layers * 3 * h * self.intermediate_size,
            shared_experts=self.num_moe_layers * self.num_shared_experts * self.params_per_expert(),
            routed_experts=self.num_moe_layers * self.num_experts * self.params_per_expert(),
            router=self.num_moe_layers * self.num_experts * h,
        )

    def active_params_per_token(self) -> float:
        """Parameters one decoded token multiplies with (the embedding is a lookup)."""
        p = self.param_counts()
        routed = p.routed_experts * self.experts_per_token / self.num_experts if self.is_moe else 0
        return p.lm_head + p.attention + p.dense_mlp + p.shared_experts + p.router + routed


def dtype_bytes(dtype: str) -> float:
    if dtype not in _DTYPE_BYTES:
        raise PlanError(f"unknown KV dtype {dtype!r}: use one of {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


def _require(cfg: dict[str, Any], key: str, name: str) -> int:
    """A size the model cannot do without: a positive integer (a zero would divide the plan by zero)."""
    value = cfg.get(key)
    if value is None:
        raise PlanError(f"model config {name} has no {key!r}: give the config.json of a "
                        "decoder-only LLM (Llama, Qwen3-MoE, DeepSeek-V2/V3, Kimi-K2 family)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"model config {name}: {key!r} must be a positive integer, got {value!r}")
    return value


def _quantization(quant: dict[str, Any] | None, is_moe: bool) -> Quantization:
    if not quant:
        return Quantization()
    method = quant.get("quant_method")
    if method == "fp8":
        return Quantization(dtype="fp8", scope="linear")
    if method == "compressed-tensors":
        for group in quant.get("config_groups", {}).values():
            weights = group.get("weights") or {}
            if weights.get("num_bits") == 4:
                # Checkpoints that ignore attention keep int4 for the experts alone
                # (Kimi K2-Thinking / K2.5 / K2.6 ship that way).
                attention_ignored = any("self_attn" in str(p) for p in quant.get("ignore", []))
                scope = "routed_experts" if is_moe and attention_ignored else "linear"
                return Quantization(dtype="int4", scope=scope, group_size=int(weights.get("group_size") or 32))
            if weights.get("num_bits") == 8:
                return Quantization(dtype="fp8", scope="linear")
    raise PlanError(f"quantization {method!r} is not understood: pass --weights-dtype bf16, fp8 or int4")


def _moe_layer_count(cfg: dict[str, Any], num_layers: int) -> int:
    if "first_k_dense_replace" in cfg:  # DeepSeek / Kimi: dense first, then every moe_layer_freq
        first, freq = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq") or 1)
        return sum(1 for i in range(num_layers) if i >= first and i % freq == 0)
    if "decoder_sparse_step" in cfg:  # Qwen-MoE: every step-th layer unless listed as dense
        step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
        return sum(1 for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return num_layers  # Mixtral-like: every layer


def parse_hf_config(cfg: dict[str, Any], name: str) -> ModelArch:
    """Build a ModelArch from a config.json dict. Multimodal configs (Kimi K2.5/K2.6)
    keep the language model under "text_config" and the quantization at the top."""
    planner = cfg.get("planner", {})
    text = cfg.get("text_config") or cfg
    name = planner.get("name", name)
    layers = _require(text, "num_hidden_layers", name)
    hidden = _require(text, "hidden_size", name)
    heads = _require(text, "num_attention_heads", name)
    vocab = _require(text, "vocab_size", name)
    num_experts = int(text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts") or 0)
    num_moe_layers = _moe_layer_count(text, layers) if num_experts else 0
    is_mla = bool(text.get("kv_lora_rank"))
    quant_cfg = cfg.get("quantization_config") or text.get("quantization_config")
    return ModelArch(
        name=name,
        attention="mla" if is_mla else "gqa",
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=1 if is_mla else int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        kv_lora_rank=int(text.get("kv_lora_rank") or 0),
        qk_rope_head_dim=int(text.get("qk_rope_head_dim") or 0) if is_mla else 0,
        qk_nope_head_dim=int(text.get("qk_nope_head_dim") or 0) if is_mla else 0,
        v_head_dim=int(text.get("v_head_dim") or 0) if is_mla else 0,
        q_lora_rank=int(text.get("q_lora_rank") or 0),
        intermediate_size=int(text.get("intermediate_size") or 0),
        num_dense_mlp_layers=layers - num_moe_layers,
        num_moe_layers=num_moe_layers,
        num_experts=num_experts,
        experts_per_token=int(text.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or text.get("intermediate_size") or 0),
        num_shared_experts=int(text.get("n_shared_experts") or 0),
        vocab_size=vocab,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        quantization=_quantization(quant_cfg, num_experts > 0),
        published_total_params_b=planner.get("published_total_params_b"),
        published_active_params_b=planner.get("published_active_params_b"),
    )
