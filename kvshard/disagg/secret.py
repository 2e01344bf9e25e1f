"""The shared secret of a disaggregated deployment: the proxy, producers and consumers all present it
(header `X-KVShard-KV-Secret`) on what they ask of each other, and refuse whoever does not.

Where it comes from, first found: the `kv_connector_extra_config.shared_secret` of `--kv-transfer-config`
(servers), `$KVSHARD_KV_TRANSFER_SECRET` (servers and proxy), or else a secret generated once and kept,
readable by its owner only, in `kv_transfer_secret` under `$KVSHARD_CACHE_DIR` (default
`~/.cache/kvshard`), which every server and proxy that this user starts on this machine reads. A
deployment over several machines sets the same secret on each.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

from kvshard import envs

HEADER = "x-kvshard-kv-secret"


def secret_file() -> Path:
    return envs.cache_dir() / "kv_transfer_secret"


def deployment_secret(configured: str | None = None) -> str:
    value = configured or envs.get("KVSHARD_KV_TRANSFER_SECRET")
    if value:
        return value
    path = secret_file()
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".kv_transfer_secret-")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            os.link(temporary, path)  # atomic, and never over a secret another process made first
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary)
    value = path.read_text().strip()
    if len(value) < 16:
        raise ValueError(f"{path} holds no usable secret (under 16 characters): delete it or set ${envs.KV_TRANSFER_SECRET}")
    return value
