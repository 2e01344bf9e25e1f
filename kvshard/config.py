"""Engine configuration: one dataclass per concern, validated before any process starts.

Every error a user can cause here raises `ConfigError` with a message that says
what to change; nothing is spawned until `EngineConfig.create` has returned.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvshard.kv.cache import KVCacheSpec, kv_cache_spec

INTERLEAVE_ENV_VARS = ("KVSHARD_DCP_KV_INTERLEAVE_SIZE", "VLLM_DCP_KV_INTERLEAVE_SIZE")
DEFAULT_KV_CACHE_MEMORY = "1GiB"

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


class ConfigError(ValueError):
    """A configuration the user can fix; the message says how."""


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


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    dcp_kv_interleave_size: int = 1
    dcp_replicate_q: bool = False

    @property
    def world_size(self) -> int:
        # DCP reuses the TP ranks: it never adds processes.
        return self.tensor_parallel_size

    @property
    def num_dcp_groups(self) -> int:
        return self.tensor_parallel_size // self.decode_context_parallel_size

    def dcp_groups(self) -> list[list[int]]:
        """Contiguous slices of the TP ranks: tp=4, dcp=2 -> [[0, 1], [2, 3]]."""
        n = self.decode_context_parallel_size
        return [list(range(g * n, (g + 1) * n)) for g in range(self.num_dcp_groups)]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int = parse_memory_size(DEFAULT_KV_CACHE_MEMORY)
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    hf_config: Any = field(repr=False)  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_position_embeddings: int
    is_mla: bool

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


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    parallel: ParallelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    seed: int = 0

    # --- KV accounting (DESIGN.md section 6), all per rank -------------------
    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """The cache one rank holds, derived once from the model: the runner allocates this spec."""
        return kv_cache_spec(self.model, self.parallel.tensor_parallel_size)

    @property
    def kv_heads_per_rank(self) -> int:
        return self.kv_cache_spec.num_kv_heads

    @property
    def kv_copies_per_token(self) -> int:
        """How many ranks store the same K/V of a token: the ranks holding one KV head, over dcp."""
        holders = max(1, self.parallel.tensor_parallel_size // self.model.num_kv_heads)
        return holders // self.parallel.decode_context_parallel_size

    @property
    def kv_bytes_per_token_per_rank(self) -> float:
        """Average bytes one token costs on one rank: a group stores each token once."""
        return self.kv_bytes_per_slot / self.parallel.decode_context_parallel_size

    @property
    def kv_bytes_per_slot(self) -> int:
        """Bytes of one physical cache slot (one token, all layers) on one rank."""
        return self.kv_cache_spec.bytes_per_slot(self.model.dtype)

    @property
    def num_kv_blocks(self) -> int:
        if self.cache.num_kv_blocks is not None:
            return self.cache.num_kv_blocks
        return self.cache.kv_cache_memory // (self.cache.block_size * self.kv_bytes_per_slot)

    @property
    def tokens_per_virtual_block(self) -> int:
        return self.cache.block_size * self.parallel.decode_context_parallel_size

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.tokens_per_virtual_block

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens that fit at once (vLLM's 'Maximum concurrency')."""
        blocks_per_request = -(-self.scheduler.max_model_len // self.tokens_per_virtual_block)
        return self.num_kv_blocks / blocks_per_request

    def layout_report(self) -> str:
        p = self.parallel
        lines = [
            f"model: {self.model.path} ({self.model.architecture}, {'MLA' if self.model.is_mla else 'GQA'}, "
            f"dtype {str(self.model.dtype).removeprefix('torch.')})",
            f"ranks: {p.world_size} (tp={p.tensor_parallel_size}, dcp={p.decode_context_parallel_size}, "
            f"interleave={p.dcp_kv_interleave_size}); DCP groups: {p.dcp_groups()}",
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
        ]
        return "\n".join(lines)

    # --- construction ------------------------------------------------------
    @classmethod
    def create(
        cls,
        model: str | os.PathLike,
        tensor_parallel_size: int = 1,
        decode_context_parallel_size: int = 1,
        dcp_kv_interleave_size: int | None = None,
        dcp_replicate_q: bool = False,
        block_size: int = 16,
        max_model_len: int | None = None,
        kv_cache_memory: int | str | None = None,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        dtype: str | torch.dtype = "auto",
        seed: int = 0,
    ) -> "EngineConfig":
        model_config = load_model_config(model, dtype)
        interleave = _resolve_interleave(dcp_kv_interleave_size)
        parallel = ParallelConfig(
            tensor_parallel_size, decode_context_parallel_size, interleave, dcp_replicate_q
        )
        _validate_parallel(parallel, model_config)
        _check_positive("block_size", block_size)
        if block_size % interleave != 0:
            raise ConfigError(
                f"block_size={block_size} is not a multiple of dcp_kv_interleave_size={interleave}: "
                f"choose an interleave size that divides the block size (1 or {block_size}, say)"
            )
        window = model_config.sliding_window
        if max_model_len is None:
            max_model_len = min(model_config.max_position_embeddings, window or model_config.max_position_embeddings)
        _check_positive("max_model_len", max_model_len)
        if window is not None and max_model_len > window:
            raise ConfigError(
                f"max_model_len={max_model_len} exceeds the model's sliding window of {window} tokens, "
                f"which kvshard does not implement: use --max-model-len {window} or less"
            )
        if max_model_len > model_config.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{model_config.max_position_embeddings}: lower --max-model-len"
            )
        if num_kv_blocks is not None:
            _check_positive("num_kv_blocks", num_kv_blocks)
        cache = CacheConfig(
            block_size,
            parse_memory_size(kv_cache_memory if kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY),
            num_kv_blocks,
        )
        _check_positive("max_num_seqs", max_num_seqs)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(512, max_num_seqs)
        _check_positive("max_num_batched_tokens", max_num_batched_tokens)
        if max_num_batched_tokens < max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens={max_num_batched_tokens} is below max_num_seqs={max_num_seqs}: "
                "every running request needs one token per decode step"
            )
        scheduler = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len)
        config = cls(model_config, parallel, cache, scheduler, seed)
        if config.kv_capacity_tokens < max_model_len:
            raise ConfigError(
                f"the KV cache holds {config.kv_capacity_tokens:,} tokens ({config.num_kv_blocks} blocks per rank), "
                f"fewer than one request of max_model_len={max_model_len}: raise --kv-cache-memory, "
                "raise --dcp, or lower --max-model-len"
            )
        return config


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _resolve_interleave(flag_value: int | None) -> int:
    """The flag wins; then KVSHARD_..., then VLLM_... (for existing recipes); default 1."""
    if flag_value is not None:
        _check_positive("dcp_kv_interleave_size", flag_value)
        return flag_value
    for name in INTERLEAVE_ENV_VARS:
        raw = os.environ.get(name)
        if raw is not None and raw.strip():
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not an integer") from None
            _check_positive(name, value)
            return value
    return 1


def _validate_parallel(parallel: ParallelConfig, model: ModelConfig) -> None:
    tp, dcp = parallel.tensor_parallel_size, parallel.decode_context_parallel_size
    _check_positive("tensor_parallel_size", tp)
    _check_positive("decode_context_parallel_size", dcp)
    if tp % dcp != 0:
        raise ConfigError(
            f"tensor_parallel_size={tp} is not divisible by decode_context_parallel_size={dcp}: "
            "DCP groups are slices of the TP ranks, so choose a dcp that divides tp"
        )
    cfg = model.hf_config
    heads = cfg.num_attention_heads
    if heads % tp != 0:
        raise ConfigError(
            f"the model has {heads} attention heads, not divisible by tensor_parallel_size={tp}: "
            "choose a tp that divides the head count"
        )
    if model.is_mla:
        return
    kv_heads = model.num_kv_heads
    if tp > kv_heads and tp % kv_heads != 0:
        raise ConfigError(
            f"tensor_parallel_size={tp} is not a multiple of the model's {kv_heads} KV heads"
        )
    if tp <= kv_heads and kv_heads % tp != 0:
        raise ConfigError(f"the model's {kv_heads} KV heads do not divide over tensor_parallel_size={tp}")
    replicas = max(1, tp // kv_heads)
    if dcp > replicas:
        raise ConfigError(
            f"decode_context_parallel_size={dcp} exceeds tp / num_kv_heads = {tp}/{kv_heads} = {replicas}: "
            "a DCP group must consist of ranks holding the same KV head, so use "
            f"--dcp {replicas} or less, or raise --tensor-parallel-size"
        )


# --- model directory ---------------------------------------------------------

def load_model_config(model: str | os.PathLike, dtype: str | torch.dtype = "auto") -> ModelConfig:
    from kvshard.models.registry import MLA_ARCHITECTURES, SUPPORTED_ARCHITECTURES, resolve_model_path

    path = resolve_model_path(model)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model directory {path} has no config.json: point --model at a Hugging Face checkpoint directory")
    raw = json.loads(config_file.read_text())
    architectures = raw.get("architectures") or []
    supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ConfigError(
            f"model at {path} has architecture {architectures or 'unknown'}, which kvshard does not support; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"model directory {path} has no *.safetensors weights")

    hf_config = _load_hf_config(path, raw, supported[0])
    checkpoint_dtype = raw.get("dtype") or raw.get("torch_dtype")
    architecture = supported[0]
    return ModelConfig(
        path=path,
        architecture=architecture,
        hf_config=hf_config,
        dtype=resolve_dtype(dtype, checkpoint_dtype),
        max_position_embeddings=hf_config.max_position_embeddings,
        is_mla=architecture in MLA_ARCHITECTURES,
    )


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
