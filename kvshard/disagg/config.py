"""`--kv-transfer-config`: an instance's role in disaggregated prefill/decode (vLLM's field names)."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from kvshard.engine.kv_connector import registered_kv_connectors
from kvshard.errors import ConfigError, json_object_setting

ROLES = ("kv_producer", "kv_consumer")
EXTRA_FIELDS = {"hold_timeout_s", "transfer_timeout_s", "producers", "shared_secret"}


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: str  # kv_producer: prefill and keep the KV until fetched; kv_consumer: fetch it and decode
    kv_connector: str = "KVShardConnector"  # a registered connector (engine/kv_connector.py); kvshard has this one
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_ip: str = "127.0.0.1"  # where this instance's KV store and transfer sockets listen (loopback by default)
    kv_port: int = 0  # producer: the store's port; 0 picks a free one
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"

    @property
    def hold_timeout_s(self) -> float:
        """Producer: seconds a finished prefill keeps its KV blocks waiting for a consumer to fetch them."""
        return float(self.kv_connector_extra_config.get("hold_timeout_s", 60.0))

    @property
    def transfer_timeout_s(self) -> float:
        """Both: seconds a transfer (rendezvous included) may take before the peer counts as gone."""
        return float(self.kv_connector_extra_config.get("transfer_timeout_s", 30.0))

    @property
    def producers(self) -> dict[str, str]:
        """Consumer: producers it may pull from, by engine id (more may be registered by the proxy)."""
        return {k: v.rstrip("/") for k, v in self.kv_connector_extra_config.get("producers", {}).items()}

    @property
    def shared_secret(self) -> str | None:
        """The deployment's secret if set here (disagg/secret.py says where it comes from otherwise)."""
        return self.kv_connector_extra_config.get("shared_secret")

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        raw = json_object_setting(text, "--kv-transfer-config", '{"kv_role": "kv_producer"}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"--kv-transfer-config: unknown field(s) {unknown}; known: {sorted(known)}")
        if raw.get("kv_role") not in ROLES:
            raise ConfigError(f"--kv-transfer-config: kv_role must be one of {list(ROLES)}, got {raw.get('kv_role')!r}")
        if raw.get("kv_connector", "KVShardConnector") not in registered_kv_connectors():
            raise ConfigError(f"--kv-transfer-config: kv_connector {raw['kv_connector']!r} is not available; "
                              f"registered: {registered_kv_connectors()} (KVShardConnector: torch.distributed "
                              "point-to-point)")
        config = cls(**raw)
        extra = config.kv_connector_extra_config
        for name in ("hold_timeout_s", "transfer_timeout_s"):
            value = extra.get(name, 1.0)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"--kv-transfer-config: kv_connector_extra_config.{name} must be seconds > 0")
        unknown_extra = sorted(set(extra) - EXTRA_FIELDS)
        if unknown_extra:
            raise ConfigError(f"--kv-transfer-config: unknown kv_connector_extra_config field(s) {unknown_extra}; "
                              f"known: {sorted(EXTRA_FIELDS)}")
        producers = extra.get("producers", {})
        if not isinstance(producers, dict) or not all(
                isinstance(k, str) and re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", k) and isinstance(v, str)
                and re.fullmatch(r"https?://[^/\s?#]+/?", v) for k, v in producers.items()):
            raise ConfigError("--kv-transfer-config: kv_connector_extra_config.producers must map producer engine "
                              'ids to their URLs, e.g. {"prefill-0": "http://127.0.0.1:8100"}')
        secret = extra.get("shared_secret")
        if secret is not None and not (isinstance(secret, str) and len(secret) >= 16):
            raise ConfigError("--kv-transfer-config: kv_connector_extra_config.shared_secret must be a string "
                              "of at least 16 characters")
        if not isinstance(config.engine_id, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", config.engine_id):
            raise ConfigError("--kv-transfer-config: engine_id must be 1-128 letters, digits or _.:-")
        if not isinstance(config.kv_ip, str) or not config.kv_ip:
            raise ConfigError("--kv-transfer-config: kv_ip must be the address to listen on, e.g. 127.0.0.1")
        if not isinstance(config.kv_port, int) or not 0 <= config.kv_port < 2**16:
            raise ConfigError(f"--kv-transfer-config: kv_port {config.kv_port!r} is not a TCP port (0 picks one)")
        return config
