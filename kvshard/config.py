"""Engine configuration: one dataclass per concern, validated before any process starts.

The settings a user gives, their defaults and checks live in `EngineArgs`
(kvshard/engine/arg_utils.py), which builds these; every error a user can cause
raises `ConfigError` with a message that says what to change, before any process starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvshard.envs import int_from_env
from kvshard.errors import ConfigError
from kvshard.kv.cache import KVCacheSpec, head_dim_of, kv_cache_spec, resolve_kv_cache_dtype
from kvshard.kv.layout import DCPLayout
from kvshard.models.demo import DEMO_MODELS, ensure_demo_model
from kvshard.models.gguf import resolve_gguf
from kvshard.models.loader import check_checkpoint_files, check_vocab_size
from kvshard.models.quantization import parse_quantization_config
from kvshard.models.registry import MLA_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from kvshard.spec_decode.config import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def parse_memory_size(value: int | str) -> int:
    """'64MiB' -> 67108864; plain integers are bytes."""
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if match is None or match.group(2).lower() not in _SIZE_UNITS:
            raise ConfigError(
                f"kv_cache_memory={value!r} is not a size: use bytes or a unit, e.g. '64MiB' or '2GiB'"
            )
        size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if size <= 0:
        raise ConfigError(f"kv_cache_memory must be positive, got {value!r}")
    return size


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = checkpoint_dtype or "float32"
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported: use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


# How a DCP group lays out its attention (DESIGN.md section 2; the planner uses the same names).
HEAD_SPLIT = "head-split"  # query heads split over all T ranks, gathered in the group: one collective more
REPLICATED = "replicated"  # every rank computes its group's queries: N x the query-side projection weights
ATTENTION_LAYOUTS = ("auto", HEAD_SPLIT, REPLICATED)
DCP_COMM_BACKENDS = ("auto", "ag_rs", "a2a")  # vLLM's --dcp-comm-backend names


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    decode_context_parallel_size: int
    dcp_kv_interleave_size: int
    attention_layout: str = HEAD_SPLIT  # resolved: HEAD_SPLIT or REPLICATED
    dcp_comm_backend: str = "auto"  # one of DCP_COMM_BACKENDS: how a DCP group merges its partial attentions

    @property
    def world_size(self) -> int:
        # DCP reuses the TP ranks: it never adds processes.
        return self.tensor_parallel_size

    @property
    def attention_tp_size(self) -> int:
        """A = T / N: attention heads split this many ways, one share per DCP group."""
        return self.tensor_parallel_size // self.decode_context_parallel_size

    @property
    def num_dcp_groups(self) -> int:
        return self.tensor_parallel_size // self.decode_context_parallel_size

    def dcp_groups(self) -> list[list[int]]:
        """Contiguous slices of the TP ranks: tp=4, dcp=2 -> [[0, 1], [2, 3]]."""
        n = self.decode_context_parallel_size
        return [list(range(g * n, (g + 1) * n)) for g in range(self.num_dcp_groups)]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kv_cache_memory: int  # bytes per rank
    num_kv_blocks: int | None  # overrides kv_cache_memory when set
    enable_prefix_caching: bool
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" (or "fp8_e4m3"): float8 e4m3


FCFS = "fcfs"  # waiting requests are admitted in arrival order
LPM = "lpm"  # longest cached prefix first (SGLang's name): a session's next turn while its prefix is cached
SCHEDULING_POLICIES = (FCFS, LPM)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = FCFS  # one of SCHEDULING_POLICIES


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
    def attention_value_dim(self) -> int:
        """Features of one head's attention output, the input of the output projection."""
        return self.hf_config.v_head_dim if self.is_mla else head_dim_of(self.hf_config)

    def head_projection_params(self, query_heads: int, kv_heads: int) -> int:
        """Parameters per layer of the projections a rank splits by head: GQA's Q, K and V for
        `query_heads` and `kv_heads` heads; MLA's Q (or q_b after the shared Q LoRA) and W_UK, which
        takes the queries into the latent (the latent's own projections are whole on every rank)."""
        cfg = self.hf_config
        if not self.is_mla:
            return (query_heads + 2 * kv_heads) * head_dim_of(cfg) * cfg.hidden_size
        q_in = cfg.q_lora_rank or cfg.hidden_size
        per_head = q_in * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) + cfg.qk_nope_head_dim * cfg.kv_lora_rank
        return query_heads * per_head

    def tp_split_sizes(self) -> dict[str, int]:
        """Sizes the MLP / experts split over all T ranks, by what they are (for error messages)."""
        cfg = self.hf_config
        routed = getattr(cfg, "n_routed_experts", None) or 0
        has_moe = routed and getattr(cfg, "first_k_dense_replace", 0) < cfg.num_hidden_layers
        sizes = {}
        if not has_moe or getattr(cfg, "first_k_dense_replace", 0) > 0:
            sizes["MLP width (intermediate_size)"] = cfg.intermediate_size
        if has_moe:
            sizes["routed experts (n_routed_experts)"] = routed
            if cfg.n_shared_experts:
                sizes["shared-expert width"] = cfg.moe_intermediate_size * cfg.n_shared_experts
        return sizes


def attention_refusal(model: ModelConfig, tp: int, dcp: int) -> str | None:
    """Why `model` cannot run on tp ranks in DCP groups of dcp in any attention layout, or None."""
    heads, kv, a = model.num_heads, model.num_kv_heads, tp // dcp
    if tp % dcp:
        return f"decode_context_parallel_size={dcp} does not divide tensor_parallel_size={tp}"
    for what, size in model.tp_split_sizes().items():
        if size % tp:
            return f"the model's {what} {size:,} does not split over tensor_parallel_size={tp}"
    if heads % a:
        return f"attention-TP A = tp/dcp = {tp}/{dcp} = {a} does not divide the model's {heads} query heads"
    if kv % a and a % kv:
        return f"attention-TP A = tp/dcp = {a} neither divides nor is a multiple of the model's {kv} KV heads"
    if heads * model.attention_value_dim % tp:
        return f"the {heads * model.attention_value_dim} attention output features do not split over tp={tp}"
    return None


def head_split_refusal(model: ModelConfig, tp: int, dcp: int) -> str | None:
    """Why the head-split layout does not apply (given attention_refusal is None), or None."""
    if dcp == 1:
        return None
    if model.num_heads % tp:
        return f"head-split needs tensor_parallel_size={tp} to divide the {model.num_heads} query heads"
    a = tp // dcp
    if a % model.num_kv_heads:
        return (f"head-split needs the ranks of a DCP group to hold the same single KV head "
                f"(dcp <= tp / num_kv_heads = {tp}/{model.num_kv_heads})")
    return None


# `auto` replicates a DCP group's queries when that costs a rank at most this many extra bytes of
# query-side weights per layer: below it, reading the weights costs less than the Q all-gather it saves
# (a collective of ~0.1 ms per layer over shared memory on a 2-core CPU; tens of microseconds over
# NCCL, against a fraction of a microsecond to read 1 MiB from HBM). Measured on the GQA demo at tp=2
# dcp=2 (BENCHMARKS.md section 2): 12.5% more time than TP alone with head-split, 0.4% replicated.
AUTO_REPLICATE_MAX_BYTES = 1 << 20


def auto_replicate_max_bytes() -> int:
    """AUTO_REPLICATE_MAX_BYTES, or KVSHARD_AUTO_REPLICATE_MAX_BYTES (0: auto always takes head-split
    where it applies; the test suite uses it to keep its tiny models on the head-split path)."""
    return int_from_env("KVSHARD_AUTO_REPLICATE_MAX_BYTES", AUTO_REPLICATE_MAX_BYTES)


def replicated_query_bytes_per_layer(model: ModelConfig, tp: int, dcp: int) -> int:
    """Query-side weight bytes a rank holds per layer in the replicated layout beyond head-split's."""
    a = tp // dcp
    group, own = model.num_heads // a, model.num_heads // tp
    extra = model.head_projection_params(group, 0) - model.head_projection_params(own, 0)
    return extra * model.dtype.itemsize


def choose_attention_layout(model: ModelConfig, tp: int, dcp: int, requested: str = "auto") -> str:
    """The layout asked for; with `auto`, REPLICATED where head-split does not apply or where
    replicating the queries costs at most auto_replicate_max_bytes() per layer, else HEAD_SPLIT.
    ConfigError saying what to change when no layout runs this model at this tp and dcp."""
    if requested not in ATTENTION_LAYOUTS:
        raise ConfigError(f"dcp_attention_layout={requested!r} is not one of {', '.join(ATTENTION_LAYOUTS)}")
    reason = attention_refusal(model, tp, dcp)
    if reason is not None:
        raise ConfigError(f"{reason}: {_what_works(model, tp)}")
    head_split = head_split_refusal(model, tp, dcp)
    if requested == HEAD_SPLIT and head_split is not None:
        raise ConfigError(f"{head_split}: use --dcp-attention-layout replicated (or auto)")
    if dcp == 1:
        return HEAD_SPLIT  # the same thing at dcp = 1
    if requested == REPLICATED or head_split is not None:
        return REPLICATED
    if requested == "auto" and replicated_query_bytes_per_layer(model, tp, dcp) <= auto_replicate_max_bytes():
        return REPLICATED
    return HEAD_SPLIT


def _what_works(model: ModelConfig, tp: int) -> str:
    dcps = [d for d in range(1, tp + 1) if tp % d == 0 and attention_refusal(model, tp, d) is None]
    if dcps:
        return f"at tensor_parallel_size={tp} use --dcp {' or '.join(map(str, dcps))}"
    tps = [(t, d) for t in range(1, 65) for d in range(1, t + 1)
           if t % d == 0 and attention_refusal(model, t, d) is None and t > 1]
    examples = ", ".join(f"tp={t} dcp={d}" for t, d in tps[:6])
    return f"no dcp works at tensor_parallel_size={tp}; choose another tp ({examples or 'tp=1'})"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    parallel: ParallelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    seed: int
    batch_invariant: bool = False  # EngineArgs.batch_invariant
    speculative: SpeculativeConfig | None = None
    attention_backend: str = "auto"  # EngineArgs.attention_backend, resolved (attention/backends.py)

    @cached_property
    def dcp_layout(self) -> DCPLayout:
        """Where each token's K/V lives in its DCP group: one object for the scheduler and every runner."""
        p = self.parallel
        return DCPLayout(self.cache.block_size, p.decode_context_parallel_size, p.dcp_kv_interleave_size)

    # --- KV accounting (DESIGN.md section 6), all per rank -------------------
    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """The cache one rank holds, derived once from the model: the runner allocates this spec."""
        return kv_cache_spec(self.model, self.parallel.attention_tp_size)

    @property
    def kv_heads_per_rank(self) -> int:
        return self.kv_cache_spec.num_kv_heads

    @property
    def kv_copies_per_token(self) -> int:
        """How many ranks store the same K/V of a token: the DCP groups holding one KV head
        (A / kv_heads when attention-TP exceeds the KV heads); a group stores it once."""
        return max(1, self.parallel.attention_tp_size // self.model.num_kv_heads)

    # --- attention layout -------------------------------------------------------------
    @property
    def query_heads_per_rank(self) -> int:
        """Heads whose query one rank computes: its 1/T share (head-split) or its group's 1/A."""
        p = self.parallel
        ways = p.attention_tp_size if p.attention_layout == REPLICATED else p.tensor_parallel_size
        return self.model.num_heads // ways

    @property
    def replicated_projection_bytes_per_rank(self) -> int:
        """Projection bytes one rank holds beyond plain TP's share of the heads (all layers; 0 for
        head-split): the group's queries, and its K/V heads when they outnumber plain TP's. The price
        of skipping the Q all-gather, counted at the model dtype."""
        model, tp = self.model, self.parallel.tensor_parallel_size
        plain_tp = model.head_projection_params(model.num_heads // tp, max(1, model.num_kv_heads // tp))
        extra = model.head_projection_params(self.query_heads_per_rank, self.kv_heads_per_rank) - plain_tp
        return model.num_layers * extra * model.dtype.itemsize

    @property
    def kv_bytes_per_token_per_rank(self) -> float:
        """Average bytes one token costs on one rank: a group stores each token once."""
        return self.kv_bytes_per_slot / self.parallel.decode_context_parallel_size

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype the cache stores; attention reads it back in the model's dtype."""
        return resolve_kv_cache_dtype(self.cache.kv_cache_dtype, self.model.dtype)

    @property
    def kv_bytes_per_slot(self) -> int:
        """Bytes of one physical cache slot (one token, all layers) on one rank; a draft model's cache
        uses the same block ids, so its slot (in the draft's dtype) counts too, as does an MTP module's."""
        slot = self.kv_cache_spec.bytes_per_slot(self.kv_cache_dtype)
        draft = self.speculative.draft_model_config if self.speculative is not None else None
        if draft is not None:
            slot += kv_cache_spec(draft, self.parallel.attention_tp_size).bytes_per_slot(draft.dtype)
        if self.speculative is not None and self.speculative.method == "mtp":
            slot += self.mtp_kv_cache_spec.bytes_per_slot(self.model.dtype)
        return slot

    @property
    def mtp_kv_cache_spec(self) -> KVCacheSpec:
        """The MTP module's cache: one more layer of the target's, in the model's dtype."""
        return dataclasses.replace(self.kv_cache_spec, num_layers=1)

    @property
    def num_kv_blocks(self) -> int:
        if self.cache.num_kv_blocks is not None:
            return self.cache.num_kv_blocks
        return self.cache.kv_cache_memory // (self.cache.block_size * self.kv_bytes_per_slot)

    @property
    def tokens_per_virtual_block(self) -> int:
        return self.dcp_layout.tokens_per_virtual_block

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.tokens_per_virtual_block

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens that fit at once (vLLM's 'Maximum concurrency')."""
        blocks_per_request = -(-self.scheduler.max_model_len // self.tokens_per_virtual_block)
        return self.num_kv_blocks / blocks_per_request

    def _prefix_caching_report(self) -> str:
        if not self.cache.enable_prefix_caching:
            return "Prefix caching: off (every prompt is computed in full)"
        dcp = self.parallel.decode_context_parallel_size
        # a block id names one physical block on every rank of the group: a hit must cover all of them
        unit = (f"whole virtual blocks of {self.tokens_per_virtual_block} tokens "
                f"(block size {self.cache.block_size} x dcp {dcp})" if dcp > 1
                else f"whole blocks of {self.cache.block_size} tokens")
        order = ("waiting requests with the longest cached prefix first (--scheduling-policy lpm)"
                 if self.scheduler.policy == LPM else "waiting requests in arrival order")
        return f"Prefix caching: on, a shared prompt prefix is reused in {unit}; {order}"

    def layout_report(self) -> str:
        p = self.parallel
        lines = [
            f"model: {self.model.path} ({self.model.architecture}, {'MLA' if self.model.is_mla else 'GQA'}, "
            f"dtype {str(self.model.dtype).removeprefix('torch.')})",
            f"ranks: {p.world_size} (tp={p.tensor_parallel_size}, dcp={p.decode_context_parallel_size}, "
            f"interleave={p.dcp_kv_interleave_size}); DCP groups: {p.dcp_groups()}",
            self._attention_line(),
            _attention_backend_line(self.attention_backend),
            f"KV cache dtype: {str(self.kv_cache_dtype).removeprefix('torch.')}; "
            f"KV bytes per token per rank: {self.kv_bytes_per_token_per_rank:,.1f} "
            f"({self.kv_bytes_per_slot:,} per slot, {self.model.num_layers} layers, "
            f"{self.kv_heads_per_rank} KV head(s) per rank)",
            f"KV blocks per rank: {self.num_kv_blocks:,} of {self.cache.block_size} tokens "
            f"({self.num_kv_blocks * self.cache.block_size * self.kv_bytes_per_slot / 2**20:,.1f} MiB per rank)",
            f"KV capacity: {self.kv_capacity_tokens:,} tokens",
            f"Maximum concurrency for {self.scheduler.max_model_len:,} tokens per request: "
            f"{self.max_concurrency:.2f}x",
            f"KV copies of each token across the {p.world_size} rank(s): {self.kv_copies_per_token}"
            + (" (replicated: raise --dcp to shard instead)" if self.kv_copies_per_token > 1 else ""),
            self._prefix_caching_report(),
        ]
        if self.speculative is not None:
            lines.append(self.speculative.describe())
        return "\n".join(lines)

    def _attention_line(self) -> str:
        p, model = self.parallel, self.model
        heads = (f"{model.num_heads // p.attention_tp_size} query heads per DCP group, "
                 f"{self.query_heads_per_rank} computed per rank")
        if p.decode_context_parallel_size == 1:
            return f"attention: TP over all {p.world_size} rank(s), {heads}"
        if p.attention_layout == HEAD_SPLIT:
            how = "queries split over all ranks, all-gathered in the group"
        else:
            how = (f"every rank computes its group's queries (replicated projections: "
                   f"+{self.replicated_projection_bytes_per_rank / 2**20:,.2f} MiB per rank, no Q all-gather)")
        return (f"attention layout: {p.attention_layout} (attention-TP A={p.attention_tp_size}; {heads}; {how}); "
                f"DCP merge: --dcp-comm-backend {p.dcp_comm_backend}")


def _attention_backend_line(name: str) -> str:
    from kvshard.attention.backends import describe_backend

    return describe_backend(name)


# --- model directory ---------------------------------------------------------

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
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"model directory {path} has no *.safetensors weights")
    shapes = check_checkpoint_files(path)
    check_config_values(config_file, raw)
    check_tokenizer_files(path)

    hf_config = _load_hf_config(path, raw, supported[0])
    check_vocab_size(config_file, hf_config.vocab_size, shapes)
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
        raise ConfigError(f"{path / 'config.json'} is invalid: {reason}") from None
