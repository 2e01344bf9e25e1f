"""Parsing the values of settings: memory sizes and dtypes (ConfigError saying what to write instead)."""

from __future__ import annotations

import re

import torch

from kvshard.errors import ConfigError

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

