"""Disaggregated prefill/decode: the `KVShardConnector` (connector.py) behind the core's KV-connector hooks
(engine/kv_connector.py), registered here, loaded only when `--kv-transfer-config` chooses it."""

from kvshard.engine.kv_connector import register_kv_connector

register_kv_connector("KVShardConnector", "kvshard.disagg.connector:KVConnector")
