"""Settings read from the environment, which spawned ranks inherit."""

from __future__ import annotations

import os


def int_from_env(name: str, default: int) -> int:
    """A non-negative integer setting from the environment, which spawned ranks inherit."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit():
        raise ValueError(f"{name}={value!r} is not a non-negative integer: set it to one, or unset it for {default}")
    return int(value)


# The shared secret of a disaggregated deployment (proxy, producers, consumers; docs/disaggregation.md).
# Unset: `kv_connector_extra_config.shared_secret`, else a secret generated once per user and machine.
KV_TRANSFER_SECRET = "KVSHARD_KV_TRANSFER_SECRET"
