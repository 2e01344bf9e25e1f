"""What clients and peers may send about a KV transfer, checked before anything acts on it.

`kv_transfer_params` on `/v1/completions` and `/v1/chat/completions` (set by `kvshard proxy`), and the
body of a consumer's `POST /kv_transfer/pull`. A request that does not fit is a 400 naming the field;
nothing here reaches the engine loop unchecked.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# transfer and engine ids: what uuid4().hex and hand-written names use; nothing that needs quoting
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")]


class KVTransferParams(BaseModel):
    """A producer's request (`do_remote_decode`: keep the KV under `transfer_id`) or a consumer's
    (`do_remote_prefill`: fetch it from the producer `remote_engine_id`). Where that producer listens
    comes from the consumer's configuration or from the proxy's registration, never from the request:
    `remote_host` and `remote_port` are refused."""

    model_config = ConfigDict(strict=True, extra="forbid")
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: Name
    remote_engine_id: Name | None = None


class PullRequest(BaseModel):
    """A consumer asks a producer for a held request's KV."""

    model_config = ConfigDict(strict=True, extra="forbid")
    transfer_id: Name
    consumer_id: Name
    generation: int = Field(ge=0, lt=2**31)
    num_tokens: int = Field(ge=0, lt=2**31)
    layout: dict
    blocks: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(max_length=2**20)
    signature: dict
    # the consumer's first num_tokens prompt token ids (`prompt_digest`): the producer checks that it prefilled
    # those very tokens, so that two sides that render or tokenize a request differently fail it, not answer wrong
    prompt_digest: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def prompt_digest(token_ids: list[int]) -> str:
    """SHA-256 of token ids (each as 4 little-endian bytes): what a pull says of the prompt whose KV it asks for."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<u4").tobytes()).hexdigest()


class Registration(BaseModel):
    """The proxy tells a consumer where a producer (by its engine id) answers pulls."""

    model_config = ConfigDict(strict=True, extra="forbid")
    engine_id: Name
    url: Annotated[str, Field(pattern=r"^https?://[^/\s?#]+$", max_length=256)]


def first_error(error: ValidationError, prefix: str) -> tuple[str, str]:
    """(message, field) of a pydantic error, the field named from `prefix`."""
    first = error.errors()[0]
    path = ".".join([prefix, *(str(p) for p in first["loc"])])
    if first["type"] == "extra_forbidden":
        return f"{path} is not accepted", path
    if first["type"] == "missing":
        return f"{path} is required", path
    return f"{path}: {first['msg'].removeprefix('Value error, ')}", path
