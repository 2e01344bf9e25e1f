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


def seconds_from_env(name: str, default: float) -> float:
    """A finite number of seconds > 0 from the environment; ConfigError names the variable."""
    from kvshard.errors import ConfigError

    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ConfigError(f"{name}={text!r} is not a number of seconds > 0: set e.g. {default:g}, or unset it")
    return value


# Every rank > 0 started by the executor on this machine ticks a counter in shared memory this often, from a
# thread of its own, busy or idle (kvshard/engine/workers.py).
DEFAULT_HEARTBEAT_INTERVAL_S = 0.5
# A rank whose counter has not moved for this long is stopped (SIGSTOP, a frozen machine): the engine ends
# with a reason naming it. Far shorter than the step timeout, which a long prefill may need.
DEFAULT_HEARTBEAT_TIMEOUT_S = 3.0


def heartbeat_interval_s() -> float:
    """$KVSHARD_HEARTBEAT_INTERVAL: seconds between two ticks of a rank's heartbeat."""
    return seconds_from_env("KVSHARD_HEARTBEAT_INTERVAL", DEFAULT_HEARTBEAT_INTERVAL_S)


def heartbeat_timeout_s() -> float:
    """$KVSHARD_HEARTBEAT_TIMEOUT: seconds without a tick after which a rank counts as stopped (also the
    deadline of the idle engine's round trip through every rank)."""
    return seconds_from_env("KVSHARD_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_TIMEOUT_S)


# The shared secret of a disaggregated deployment (proxy, producers, consumers; docs/disaggregation.md).
# Unset: `kv_connector_extra_config.shared_secret`, else a secret generated once per user and machine.
KV_TRANSFER_SECRET = "KVSHARD_KV_TRANSFER_SECRET"
