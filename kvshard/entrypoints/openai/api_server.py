"""The OpenAI-compatible server: the FastAPI app over one engine and its routes.

/v1/models, /v1/completions, /v1/chat/completions, /v1/responses, /health, /metrics, and vLLM's
POST /reset_prefix_cache, /tokenize and /detokenize. Each route's serving lives in its own module
(serving_completion, serving_chat, serving_responses, serving_tokenization; what they share in
serving_engine); the request models in protocol; the door in front of every route in door.

Every error a client can cause is answered with a 4xx in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, before anything reaches the
engine; a dead engine answers 503 with the reason, and a request that fails
alone (sampling or post-processing) gets a 500 of its own while the engine serves
on. A client that goes away, streaming or not, has its request aborted and its KV
blocks freed; so has a streaming client that stops reading, once it falls
`max_stream_backlog` tokens behind.
"""

from __future__ import annotations

import asyncio
import threading
import json
import secrets
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvshard.engine.async_engine import AsyncLLMEngine
from kvshard.engine.llm_engine import EngineDeadError, LLMEngine
from kvshard.entrypoints.openai.door import RequestDoor
from kvshard.entrypoints.openai.protocol import (DEFAULT_MAX_CHOICES_PER_REQUEST, DEFAULT_MAX_REQUEST_BODY_BYTES,
                                                 DEFAULT_MAX_STREAM_BACKLOG, DEFAULT_REQUEST_READ_TIMEOUT, APIError,
                                                 _engine_dead)
from kvshard.entrypoints.openai.serving_chat import ChatServing
from kvshard.entrypoints.openai.serving_completion import CompletionServing
from kvshard.entrypoints.openai.serving_engine import ServingBase
from kvshard.entrypoints.openai.token_bytes import token_bytes
from kvshard.entrypoints.openai.serving_responses import (DEFAULT_MAX_STORED_RESPONSES, ResponsesServing,
                                                          ResponseStore)
from kvshard.entrypoints.openai.serving_tokenization import TokenizationServing
from kvshard.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from kvshard.metrics import ServerMetrics
from kvshard.sampling_params import StructuredOutputsParams


def check_compiles(constraint: StructuredOutputsParams) -> None:
    """The grammar backend's own parse of a constraint, without a tokenizer (used where the engine has no check
    of its own): an invalid JSON schema, a regex or an EBNF grammar it cannot parse raise."""
    kind = constraint.kind()
    if kind in ("choice", "json_object"):
        return
    import xgrammar

    value = getattr(constraint, kind)
    if kind == "json":
        xgrammar.Grammar.from_json_schema(value if isinstance(value, str) else json.dumps(value))
    elif kind == "regex":
        xgrammar.Grammar.from_regex(value)
    else:
        xgrammar.Grammar.from_ebnf(value)


class OpenAIServer(ServingBase, CompletionServing, ChatServing, ResponsesServing, TokenizationServing):
    """The routes over one engine. `app` is the FastAPI application; its lifespan starts the
    engine loop and, at the end, stops every rank."""

    def __init__(self, engine: LLMEngine, served_model_names: list[str], api_key: str | None = None,
                 max_stream_backlog: int | None = None,
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT,
                 max_choices_per_request: int = DEFAULT_MAX_CHOICES_PER_REQUEST,
                 public_metrics: bool = False, enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None, chat_template: str | None = None,
                 max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES, stream_interval: int = 1) -> None:
        self.model_names = served_model_names
        self.tokenizer = engine.tokenizer
        self.validate_prompt = engine.validate_prompt
        self.max_model_len = engine.config.scheduler.max_model_len
        self.max_request_body_bytes = max_request_body_bytes
        self.request_read_timeout = request_read_timeout
        self.max_choices_per_request = max_choices_per_request
        self.public_metrics = public_metrics
        # A prompt of more characters than this cannot fit in max_model_len tokens whatever it says: no token
        # stands for more characters than the longest one in the vocabulary (twice that, for normalizers
        # that merge characters). Such a prompt is refused before it is tokenized.
        self.max_prompt_chars = 2 * self.max_model_len * _longest_token_chars(self.tokenizer)
        self.vocab_size = engine.config.model.hf_config.vocab_size
        # the tokens' raw bytes for logprobs (token_bytes.py: up to a second for a large vocabulary), built off the
        # event loop now rather than on it at the first request that asks for logprobs
        self.stop_token_ids = engine.structured.stop_token_ids  # as the grammar backend's: one TokenizerInfo
        threading.Thread(target=token_bytes, args=(self.tokenizer, self.vocab_size, self.stop_token_ids),
                         name="token-bytes", daemon=True).start()
        self.max_stream_backlog = max_stream_backlog or _backlog_from_env()
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self.stream_interval = stream_interval  # tokens per streamed event after a choice's first
        self.model_root = str(engine.config.model.path)
        # the sampling defaults of requests that leave them out (--generation-config; config/generation.py)
        self.sampling_defaults = dict(engine.config.generation.values)
        self.metrics = ServerMetrics(engine.config, served_model_names[0])
        self.engine = AsyncLLMEngine(engine, self.metrics)
        self._reset_engine_prefix_cache = engine.reset_prefix_cache
        self._engine_stats = engine.stats
        self.api_key = api_key
        # disagg/routes.py: checks `kv_transfer_params` (and the peer's secret) on servers that transfer KV
        self.check_kv_transfer: Callable[[dict, Any], dict] | None = None
        # tools and structured outputs (docs/serving.md, "Tool calling")
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME "
                             f"(one of {', '.join(sorted(TOOL_PARSERS))})")
        self.tool_parser = get_tool_parser(tool_call_parser) if enable_auto_tool_choice else None
        self.chat_template = chat_template
        self.check_structured_outputs = getattr(engine, "check_structured_outputs", None) or check_compiles
        self.response_store = ResponseStore(max_stored_responses)
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI):
            self.engine.start()
            try:
                yield
            finally:
                self.engine.shutdown()

        app = FastAPI(title="kvshard", lifespan=lifespan)
        # /kv_transfer/* (disaggregated serving) checks its callers in its own routes
        app.add_middleware(RequestDoor, max_body_bytes=self.max_request_body_bytes,
                           read_timeout=self.request_read_timeout, api_key=self.api_key,
                           open_paths=("/health", "/metrics") if self.public_metrics else ("/health",),
                           open_prefixes=("/kv_transfer/",))
        app.add_exception_handler(APIError, lambda request, error: error.response())
        app.add_exception_handler(EngineDeadError, lambda request, error: _engine_dead(str(error)).response())
        app.add_exception_handler(StarletteHTTPException, _http_error)
        app.add_exception_handler(Exception, _internal_error)

        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        app.post("/reset_prefix_cache", dependencies=[Depends(self.check_api_key)])(self.reset_prefix_cache)
        app.post("/tokenize", dependencies=[Depends(self.check_api_key)])(self.tokenize)
        app.post("/detokenize", dependencies=[Depends(self.check_api_key)])(self.detokenize)
        v1 = APIRouter(prefix="/v1", dependencies=[Depends(self.check_api_key)])
        v1.get("/models")(self.models)
        v1.post("/completions")(self.completions)
        v1.post("/chat/completions")(self.chat_completions)
        v1.post("/responses")(self.responses)
        app.include_router(v1)
        return app

    # --- plain routes -------------------------------------------------------------------
    async def health(self) -> Response:
        reason = self.engine.refusal
        if reason is not None:
            return _engine_dead(reason).response()
        return JSONResponse({"status": "ok"})

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def reset_prefix_cache(self) -> Response:
        """Forget every cached prefix (vLLM's route): the next requests compute their whole prompt.
        Running requests keep their blocks."""
        self._check_alive()

        def reset() -> None:  # waits for the step in progress, so off the event loop
            self._reset_engine_prefix_cache()
            self.metrics.record_stats(self._engine_stats())  # the cached-block gauge drops now, not at the next step

        await asyncio.to_thread(reset)
        return Response(status_code=200)

    async def check_api_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def models(self) -> dict:
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "kvshard", "root": self.model_root,
             "max_model_len": self.max_model_len}
            for name in self.model_names
        ]}


def _longest_token_chars(tokenizer) -> int:
    """Characters of the vocabulary's longest token (byte-level vocabularies write one character per byte)."""
    if tokenizer is None:
        return 1
    try:
        return max(map(len, tokenizer.get_vocab()), default=1) or 1
    except Exception:  # a tokenizer without a vocabulary to list
        return 1024


def _backlog_from_env() -> int:
    from kvshard import envs

    return envs.get("KVSHARD_MAX_STREAM_BACKLOG")  # ConfigError (a ValueError) naming it when not >= 1


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    messages = {404: f"Invalid URL ({request.method} {request.url.path})",
                405: f"Method {request.method} is not allowed on {request.url.path}"}
    return APIError(error.status_code, messages.get(error.status_code, str(error.detail))).response()


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    return APIError(500, f"internal error: {error!r}", type="server_error").response()


