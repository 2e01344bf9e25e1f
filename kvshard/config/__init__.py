"""Engine configuration, one job per module, validated before any process starts.

- `layout_rules`: which (tp, dcp, layout) combinations run a model's attention and what each costs a rank;
  torch-free, shared with the planner (kvshard/planner/layout.py).
- `layout`: the engine's policy over those rules: the MLP's split, `--dcp-attention-layout auto`.
- `settings`: the parallel, cache and scheduler dataclasses.
- `model`: `ModelConfig`, what the engine reads of a checkpoint's config.
- `model_dir`: finding and checking a model directory (demo models, GGUF, config.json, tokenizer files).
- `parsing`: memory sizes and dtypes.
- `engine`: `EngineConfig` and its byte accounting (KV bytes, blocks, capacity per rank).
- `report`: the start-up report.

The settings a user gives, their defaults and checks live in `EngineArgs` (kvshard/engine/arg_utils.py),
which builds these; every error a user can cause raises `ConfigError` saying what to change. The
environment's settings are declared in kvshard/envs.py.

`from kvshard.config import X` works for every name below; each submodule is imported when one of its
names is first asked for, so that `kvshard.config.layout_rules` (the planner's) loads without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_NAMES = {
    "kvshard.errors": ("ConfigError",),
    "kvshard.config.layout_rules": ("HEAD_SPLIT", "REPLICATED", "ATTENTION_LAYOUTS", "AttentionShape"),
    "kvshard.config.settings": ("DCP_COMM_BACKENDS", "FCFS", "LPM", "SCHEDULING_POLICIES", "CacheConfig",
                                "ParallelConfig", "SchedulerConfig"),
    "kvshard.config.parsing": ("parse_memory_size", "resolve_dtype"),
    "kvshard.config.model": ("ModelConfig", "plain_hf_config"),
    "kvshard.config.layout": ("AUTO_REPLICATE_MAX_BYTES", "attention_refusal", "auto_replicate_max_bytes",
                              "choose_attention_layout", "head_split_refusal", "replicated_query_bytes_per_layer"),
    "kvshard.config.engine": ("EngineConfig",),
    "kvshard.config.model_dir": ("check_config_values", "check_tokenizer_files", "load_model_config",
                                 "resolve_model_path"),
}
_HOME = {name: module for module, names in _NAMES.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'kvshard.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # asked once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what the names are, for readers and type checkers
    from kvshard.config.engine import EngineConfig
    from kvshard.config.layout import (
        AUTO_REPLICATE_MAX_BYTES, attention_refusal, auto_replicate_max_bytes, choose_attention_layout,
        head_split_refusal, replicated_query_bytes_per_layer,
    )
    from kvshard.config.layout_rules import ATTENTION_LAYOUTS, HEAD_SPLIT, REPLICATED, AttentionShape
    from kvshard.config.model import ModelConfig, plain_hf_config
    from kvshard.config.model_dir import (
        check_config_values, check_tokenizer_files, load_model_config, resolve_model_path,
    )
    from kvshard.config.parsing import parse_memory_size, resolve_dtype
    from kvshard.config.settings import (
        DCP_COMM_BACKENDS, FCFS, LPM, SCHEDULING_POLICIES, CacheConfig, ParallelConfig, SchedulerConfig,
    )
    from kvshard.errors import ConfigError
