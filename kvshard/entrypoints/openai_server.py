"""OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics,
and vLLM's POST /reset_prefix_cache.

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
import json
import logging
import os
import secrets
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import h11
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvshard.engine.async_engine import AsyncLLMEngine
from kvshard.engine.llm_engine import EngineDeadError, LLMEngine
from kvshard.metrics import ServerMetrics
from kvshard.outputs import CompletionOutput, RequestOutput
from kvshard.sampling_params import MAX_LOGPROBS, SamplingParams

logger = logging.getLogger("kvshard.server")

# Used when the tokenizer brings no chat template of its own.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
MAX_N = 128  # OpenAI's limit on choices per request
# Tokens a stream may run ahead of what its client has read before it is aborted. Beyond this the
# client has stopped reading (kernel buffers are already full), and its KV blocks serve better elsewhere.
DEFAULT_MAX_STREAM_BACKLOG = 1024
# The door (docs/serving.md, "Limits and security"): what one request may bring, and how slowly.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 2**20
DEFAULT_REQUEST_READ_TIMEOUT = 30.0  # seconds for a request's headers, and again for its body
DEFAULT_MAX_CHOICES_PER_REQUEST = 256  # prompts x n
DEFAULT_TIMEOUT_KEEP_ALIVE = 5  # uvicorn's and vLLM's default


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _engine_dead(reason: str) -> APIError:
    return APIError(503, f"the engine is dead: {reason}", code="engine_dead", type="server_error")


def _request_failed(reason: str) -> APIError:
    """This request alone failed behind the door; the engine serves on."""
    return APIError(500, f"the request failed: {reason}", code="request_failed", type="server_error")


# --- protocol ---------------------------------------------------------------------------

def _check_prompt(value: Any) -> Any:
    """str | list[str] | list[int] | list[list[int]], with one message for every other shape."""
    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str) or is_ids(value):
        return value
    if isinstance(value, list) and value and (all(isinstance(p, str) for p in value) or all(is_ids(p) for p in value)):
        return value
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False)
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields both endpoints take. Unknown fields are ignored, as vLLM does."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)  # no NaN, Infinity
    model: str
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # vLLM's extension, as the two below
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token ids as strings, as OpenAI's
    min_p: float = 0.0  # vLLM's extensions, as top_k
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    bad_words: list[str] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # disaggregated prefill/decode, set by `kvshard proxy`
    # vLLM fields kvshard does not implement: declared so that a value other than their no-op one is
    # refused (check_supported) rather than silently ignored
    use_beam_search: Any = None
    length_penalty: Any = None
    early_stopping: Any = None
    prompt_logprobs: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None

    # field -> the values that change nothing (None: absent)
    _NO_OP_VALUES: ClassVar[dict[str, tuple]] = {
        "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "early_stopping": (None, False),
        "prompt_logprobs": (None,), "include_stop_str_in_output": (None, False),
        "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
        "truncate_prompt_tokens": (None,), "allowed_token_ids": (None,), "guided_json": (None,),
        "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
        "logits_processors": (None,), "return_tokens_as_token_ids": (None, False),
    }

    def check_supported(self) -> None:
        for name, no_op in self._NO_OP_VALUES.items():
            value = getattr(self, name)
            # (a bool is an int in Python: True must not pass for 1)
            if not any(value is v or (type(value) is type(v) and value == v) for v in no_op):
                default = "leave it out" if no_op == (None,) else f"leave it at {no_op[-1]!r} or out"
                raise APIError(400, f"{name} is not supported by kvshard; {default}", name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        if self.n > MAX_N:
            raise APIError(400, f"n must be at most {MAX_N}, got {self.n}", "n")

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's string keys -> token ids."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()) or len(key) > 19:
                raise APIError(400, f"logit_bias keys must be token ids written as decimal strings, got {key!r}",
                               "logit_bias")
            bias[int(key)] = value
        return bias

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        logit_bias = self._logit_bias()
        try:
            return SamplingParams(
                n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos, logprobs=logprobs, kv_transfer_params=self.kv_transfer_params,
                min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                min_tokens=self.min_tokens, logit_bias=logit_bias, bad_words=self.bad_words,
            )
        except ValueError as error:
            message = str(error)
            raise APIError(400, message, message.split()[0]) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    prompt: Annotated[Any, BeforeValidator(_check_prompt)]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported by kvshard", "echo")
        if self.suffix is not None:
            raise APIError(400, "suffix is not supported by kvshard", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported by kvshard", "best_of")


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    best_of: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError(400, "tools are not supported by kvshard", "tools")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise APIError(400, "response_format other than {'type': 'text'} is not supported by kvshard",
                           "response_format")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported by kvshard", "best_of")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                           "top_logprobs")


def _parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {first['ctx']['error']}") from None
        # keep field names and list indices; drop the names pydantic gives to union members
        path = [str(p) for p in first["loc"] if isinstance(p, int) or (p.isidentifier() and p.islower()
                                                                      and p not in _TYPE_NAMES)]
        message = first["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{'.'.join(path)}: {message}" if path else message, path[0] if path else None) from None


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


# --- generation -------------------------------------------------------------------------------

@dataclass
class _ChoiceDelta:
    """New output of one choice since the last chunk."""

    index: int  # prompt_index * n + the completion's index, as OpenAI numbers choices
    prompt_index: int
    num_cached_tokens: int  # of its prompt: tokens whose KV the prefix cache gave
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


async def _merged(engine: AsyncLLMEngine, request_id: str, prompts: list[list[int]], params: SamplingParams,
                  stream: bool, max_backlog: int | None = None,
                  cut: asyncio.Event | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of every prompt as they come, tagged with the prompt's index; closing this aborts the rest.

    Outputs are cumulative, so only each prompt's newest one waits to be taken: a slow reader costs no
    memory. With `max_backlog`, a prompt whose newest output runs more tokens ahead of the last one
    taken is aborted (its KV blocks freed) and `cut` is set: its client has stopped reading.
    """
    newest: dict[int, RequestOutput | Exception] = {}
    taken: dict[int, int] = {}  # tokens of each prompt already handed out
    arrived = asyncio.Event()

    async def pump(index: int, prompt: list[int]) -> None:
        try:
            async with aclosing(engine.generate(f"{request_id}-{index}", prompt, params, stream)) as generator:
                async for output in generator:
                    newest[index] = output
                    arrived.set()
                    behind = _num_tokens(output) - taken.get(index, 0)
                    if max_backlog is not None and not output.finished and behind > max_backlog:
                        raise _StreamBacklog(f"{request_id}-{index}: the client stopped reading, {behind} tokens "
                                             f"behind (limit {max_backlog}); aborted")
        except Exception as error:  # leaving the generator above aborted the request
            newest[index] = error
            arrived.set()
            if isinstance(error, _StreamBacklog) and cut is not None:
                logger.warning("%s", error)
                cut.set()

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        remaining = set(range(len(prompts)))
        while remaining:
            await arrived.wait()
            arrived.clear()
            ready = sorted(newest.items(), key=lambda item: item[0])
            newest.clear()
            for index, item in ready:
                if isinstance(item, Exception):
                    raise item
                if item.error is not None:
                    raise _request_failed(item.error)
                taken[index] = _num_tokens(item)
                yield index, item
                if item.finished:
                    remaining.discard(index)
    finally:
        for task in tasks:
            task.cancel()


class _StreamBacklog(APIError):
    """A streaming client fell too far behind: its request was aborted (and its connection is cut, so
    this reaches the client only if it reads again before the cut)."""

    def __init__(self, message: str) -> None:
        super().__init__(500, message, code="stream_backlog", type="server_error")


def _num_tokens(output: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in output.outputs)


async def _deltas(engine: AsyncLLMEngine, request_id: str, prompts: list[list[int]], params: SamplingParams,
                  max_backlog: int, cut: asyncio.Event) -> AsyncIterator[_ChoiceDelta]:
    """Streaming: each choice's text as it becomes final.

    Held back until the choice ends: the last characters that might start a stop
    string, and an incomplete UTF-8 character (decoded as U+FFFD for now).
    """
    holdback = max((len(s) for s in params.stop), default=1) - 1
    sent_text: dict[int, str] = {}
    sent_tokens: dict[int, int] = {}
    finished: set[int] = set()
    async for prompt_index, output in _merged(engine, request_id, prompts, params, True, max_backlog, cut):
        for completion in output.outputs:
            index = prompt_index * params.n + completion.index
            if index in finished:
                continue  # the request goes on for its other choices
            text = completion.text
            if completion.finished:
                finished.add(index)
            else:
                text = text[: len(text) - holdback].rstrip("\ufffd")
            delta = text[len(sent_text.get(index, "")):]
            if not delta and not completion.finished:
                continue
            first = sent_tokens.get(index, 0)
            sent_text[index], sent_tokens[index] = text, len(completion.token_ids)
            yield _ChoiceDelta(index, prompt_index, output.num_cached_tokens or 0, delta, completion.token_ids[first:],
                               completion.logprobs[first:] if completion.logprobs is not None else None,
                               completion.finish_reason)


async def _final_outputs(engine: AsyncLLMEngine, request_id: str, prompts: list[list[int]],
                         params: SamplingParams) -> list[RequestOutput]:
    final: dict[int, RequestOutput] = {}
    async for index, output in _merged(engine, request_id, prompts, params, stream=False):
        final[index] = output
    return [final[i] for i in range(len(prompts))]


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work) -> asyncio.Task:
    """Run `work`, cancelled (and unwound: its request aborted) if the client hangs up first; the task, done."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task


async def _unless_disconnected(request: Request, work):
    """`work`'s result, or None if the client hung up first (the work then cancelled)."""
    task = await until_disconnected(request, work)
    return None if task.cancelled() else task.result()


def _usage(prompts: list[list[int]], completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage; `cached_tokens`: prompt tokens the prefix cache served (their KV was not computed)."""
    prompt_tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _cached_tokens(outputs: list[RequestOutput]) -> int:
    return sum(output.num_cached_tokens or 0 for output in outputs)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


class _CuttableStream(StreamingResponse):
    """An event stream that stops, resetting its connection, once `cut` is set (its client stopped reading,
    so a last event could not reach it anyway)."""

    def __init__(self, content: AsyncIterator[str], cut: asyncio.Event) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.cut = cut

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(super().__call__(scope, receive, send))
        cut = asyncio.ensure_future(self.cut.wait())
        try:
            await asyncio.wait({stream, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut.cancel()
            stream.cancel()  # stuck writing to a client that does not read
        await asyncio.gather(stream, return_exceptions=True)
        if self.cut.is_set():
            reset_connection(scope)
        if not stream.cancelled() and stream.exception() is not None:
            raise stream.exception()


TRANSPORT_EXTENSION = "kvshard.transport"


def with_connection_transport(app):
    """The ASGI app, told its connection's transport (scope["extensions"]["kvshard.transport"]).

    A closed connection is only closed once the client has read what the server queued for it: for a
    client that stopped reading, minutes, or never. To cut such a connection the server needs its
    transport, which ASGI does not give: uvicorn's `send` is a method of the object that holds it.
    Without that (another server), connections close as the server closes them.
    """
    async def app_with_transport(scope, receive, send) -> None:
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if scope["type"] == "http" and isinstance(transport, asyncio.Transport):
            scope = {**scope, "extensions": {**(scope.get("extensions") or {}), TRANSPORT_EXTENSION: transport}}
        await app(scope, receive, send)

    return app_with_transport


def reset_connection(scope) -> None:
    """Drop the connection now, with what is queued for its client (a TCP reset, not a close that waits
    for the client to read)."""
    transport = (scope.get("extensions") or {}).get(TRANSPORT_EXTENSION)
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() resets
    transport.abort()


# --- the door: what reaches a route at all ----------------------------------------------------

class RequestDoor:
    """ASGI middleware in front of every route (also the proxy's).

    In order: the API key (every path but `open_paths`); a request with both Content-Length and
    Transfer-Encoding is refused (400: the two framings could disagree); a POST that carries a body must
    say `Content-Type: application/json` (415: a web page may post text/plain cross-origin without asking);
    a Content-Length over `max_body_bytes` is refused before a byte of the body is read (413), and so is a
    chunked body once it passes the limit; a body that takes longer than `read_timeout` seconds to arrive
    is a 408, and its connection is closed.
    """

    def __init__(self, app, max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT, api_key: str | None = None,
                 open_paths: tuple[str, ...] = ("/health",), open_prefixes: tuple[str, ...] = ()) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        self.api_key = api_key
        self.open_paths = open_paths
        self.open_prefixes = open_prefixes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            # a body the request may still send is read and dropped by the server (timed_h11_protocol), so
            # that its client sees this answer; but one whose framing is in doubt ends the connection
            close = {"connection": "close"} if refusal.status == 400 else {}
            await JSONResponse(refusal.body(), status_code=refusal.status, headers=close)(scope, receive, send)
            return
        has_body = "transfer-encoding" in headers or headers.get("content-length", "0") != "0"
        body_done = not has_body
        received = 0
        deadline: float | None = None
        loop = asyncio.get_running_loop()

        async def limited_receive():
            nonlocal body_done, received, deadline
            if body_done:
                return await receive()
            if deadline is None:
                deadline = loop.time() + self.read_timeout
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise _BodyTooSlow(self.read_timeout) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _body_too_large(self.max_body_bytes)
                body_done = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)

    def _refusal(self, scope, headers: Headers) -> APIError | None:
        path = scope["path"]
        if (self.api_key is not None and path not in self.open_paths
                and not any(path.startswith(prefix) for prefix in self.open_prefixes)):
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        if "transfer-encoding" in headers and "content-length" in headers:
            return APIError(400, "a request may not have both Content-Length and Transfer-Encoding")
        has_body = "transfer-encoding" in headers or headers.get("content-length", "0") != "0"
        if scope["method"] == "POST" and has_body:
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":
                return APIError(415, f"Content-Type must be application/json, got {media_type or 'none'!r}",
                                code="unsupported_media_type")
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return APIError(400, f"Content-Length {length!r} is not a number of bytes")
            if int(length) > self.max_body_bytes:
                return _body_too_large(self.max_body_bytes)
        return None


class _BodyTooSlow(APIError):
    def __init__(self, timeout: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout:g} s (--request-read-timeout)",
                         code="request_timeout")

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={"connection": "close"})


def _body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit:,} bytes (--max-request-body-bytes)",
                    code="request_too_large")


def timed_h11_protocol(read_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with deadlines where uvicorn has none (a client that sends a byte a second
    would keep its connection forever): for each request's line and headers, from when the connection
    opens or the previous response ends; and for the rest of a body that a response came before (a
    refusal), which is read and dropped so that the client sees the answer rather than a reset. A client
    that is not done in `read_timeout` seconds has its connection closed."""

    class TimedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _waiting_in: Any = None  # the state of the client's side that it must leave in time

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._start_clock(h11.IDLE)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._timer is not None and self.conn.their_state is not self._waiting_in:
                self._stop_clock()
                if self.conn.their_state is h11.IDLE:  # a dropped body ended: the next request's headers
                    self._start_clock(h11.IDLE)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                self._start_clock(self.conn.their_state)

        def connection_lost(self, exc) -> None:
            self._stop_clock()
            super().connection_lost(exc)

        def _start_clock(self, waiting_in) -> None:
            self._stop_clock()
            self._waiting_in = waiting_in
            self._timer = self.loop.call_later(read_timeout, self._too_slow)

        def _stop_clock(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _too_slow(self) -> None:
            self._timer = None
            if self.conn.their_state is self._waiting_in and not self.transport.is_closing():
                self.transport.close()

    return TimedH11Protocol


# --- the app ----------------------------------------------------------------------------------

class OpenAIServer:
    """The routes over one engine. `app` is the FastAPI application; its lifespan starts the
    engine loop and, at the end, stops every rank."""

    def __init__(self, engine: LLMEngine, served_model_names: list[str], api_key: str | None = None,
                 max_stream_backlog: int | None = None,
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT,
                 max_choices_per_request: int = DEFAULT_MAX_CHOICES_PER_REQUEST,
                 public_metrics: bool = False) -> None:
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
        self.max_stream_backlog = max_stream_backlog or _backlog_from_env()
        self.model_root = str(engine.config.model.path)
        self.metrics = ServerMetrics(engine.config, served_model_names[0])
        self.engine = AsyncLLMEngine(engine, self.metrics)
        self._reset_engine_prefix_cache = engine.reset_prefix_cache
        self._engine_stats = engine.stats
        self.api_key = api_key
        # disagg/routes.py: checks `kv_transfer_params` (and the peer's secret) on servers that transfer KV
        self.check_kv_transfer: Callable[[dict, Any], dict] | None = None
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
        v1 = APIRouter(prefix="/v1", dependencies=[Depends(self.check_api_key)])
        v1.get("/models")(self.models)
        v1.post("/completions")(self.completions)
        v1.post("/chat/completions")(self.chat_completions)
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

    # --- generation routes --------------------------------------------------------------
    def _check_request(self, request: _GenerationRequest, http: Request | None = None) -> None:
        if request.model not in self.model_names:
            raise APIError(404, f"The model `{request.model}` does not exist.", "model", "model_not_found")
        request.check_supported()
        if request.kv_transfer_params is not None:
            if self.check_kv_transfer is None:
                raise APIError(400, "kv_transfer_params needs a server started with --kv-transfer-config",
                               "kv_transfer_params")
            request.kv_transfer_params = self.check_kv_transfer(request.kv_transfer_params,
                                                                http.headers if http is not None else {})
        if any(not 0 <= t < self.vocab_size for t in request.stop_token_ids or []):
            raise APIError(400, f"stop_token_ids must be token ids in [0, {self.vocab_size})", "stop_token_ids")

    def _check_choices(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_choices_per_request:
            param = "n" if n > 1 else "prompt"
            raise APIError(400, f"{param}: {num_prompts} prompts x n={n} ask for {num_prompts * n} choices, more "
                                f"than {self.max_choices_per_request} per request (--max-choices-per-request)",
                           param)

    def _check_prompt_length(self, prompt: str | list[int], param: str) -> None:
        """What cannot fit in max_model_len tokens, refused before any tokenizing."""
        if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
            raise APIError(400, f"{param}: {len(prompt):,} characters cannot fit in this model's maximum context "
                                f"length of {self.max_model_len} tokens", param)
        if isinstance(prompt, list) and len(prompt) >= self.max_model_len:
            raise APIError(400, f"{param}: {len(prompt):,} token ids do not fit in this model's maximum context "
                                f"length of {self.max_model_len} tokens", param)

    async def _tokenize(self, prompts: list[str | list[int]], params: SamplingParams, param: str) -> list[list[int]]:
        """Every prompt checked and tokenized, off the event loop (a long prompt takes seconds)."""
        for prompt in prompts:
            if isinstance(prompt, str) and self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param)
            self._check_prompt_length(prompt, param)
        try:
            return await asyncio.to_thread(lambda: [self.validate_prompt(p, params) for p in prompts])
        except ValueError as error:
            field = str(error).split()[0]  # the sampling fields checked against the model name themselves
            raise APIError(400, str(error), field if field in ("logit_bias", "bad_words") else param) from None

    def _check_alive(self) -> None:
        if self.engine.refusal is not None:
            raise _engine_dead(self.engine.refusal)

    async def completion_inputs(self, request: Request) -> tuple[CompletionRequest, SamplingParams, list[list[int]]]:
        """A completion request checked as a whole and tokenized: what /v1/completions generates from (and
        what a disaggregated consumer's check route answers for before its producer prefills)."""
        body = _parse(CompletionRequest, await request.body())
        self._check_request(body, request)
        params = body.sampling_params(body.max_tokens, body.logprobs)
        raw = body.prompt
        raw_prompts = [raw] if isinstance(raw, str) or not raw or isinstance(raw[0], int) else raw
        self._check_choices(len(raw_prompts), params.n)
        return body, params, await self._tokenize(raw_prompts, params, "prompt")

    async def completions(self, request: Request) -> Response:
        body, params, prompts = await self.completion_inputs(request)
        self._check_alive()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        envelope = {"id": request_id, "object": "text_completion", "created": created, "model": body.model}

        if body.stream:
            return self._stream(envelope, request_id, prompts, params, body.include_usage, lambda delta: {
                "index": delta.index, "text": delta.text,
                "logprobs": self._completion_logprobs(delta.token_ids, delta.logprobs),
                "finish_reason": delta.finish_reason})

        outputs = await _unless_disconnected(request, _final_outputs(self.engine, request_id, prompts, params))
        if outputs is None:
            return Response(status_code=499)  # the client is gone
        choices, completion_tokens = [], 0
        for prompt_index, output in enumerate(outputs):
            for c in output.outputs:
                completion_tokens += len(c.token_ids)
                choices.append({"index": prompt_index * params.n + c.index, "text": c.text,
                                "logprobs": self._completion_logprobs(c.token_ids, c.logprobs),
                                "finish_reason": c.finish_reason})
        usage = _usage(prompts, completion_tokens, _cached_tokens(outputs))
        return JSONResponse({**envelope, "choices": choices, "usage": usage})

    async def chat_inputs(self, request: Request) -> tuple[ChatCompletionRequest, SamplingParams, list[list[int]]]:
        """A chat request checked as a whole, templated and tokenized (see completion_inputs)."""
        body = _parse(ChatCompletionRequest, await request.body())
        self._check_request(body, request)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        self._check_choices(1, params.n)
        return body, params, await self._tokenize([await self._render_chat(body)], params, "messages")

    async def chat_completions(self, request: Request) -> Response:
        body, params, prompts = await self.chat_inputs(request)
        self._check_alive()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        envelope = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": body.model}
        top = body.top_logprobs or 0

        if body.stream:
            roles = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for index in range(params.n)]
            return self._stream(envelope, request_id, prompts, params, body.include_usage, lambda delta: {
                "index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                "logprobs": self._chat_logprobs(delta.token_ids, delta.logprobs, top),
                "finish_reason": delta.finish_reason}, first_choices=roles)

        outputs = await _unless_disconnected(request, _final_outputs(self.engine, request_id, prompts, params))
        if outputs is None:
            return Response(status_code=499)
        completions: list[CompletionOutput] = outputs[0].outputs
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, top),
                    "finish_reason": c.finish_reason} for c in completions]
        usage = _usage(prompts, sum(len(c.token_ids) for c in completions), _cached_tokens(outputs))
        return JSONResponse({**envelope, "object": "chat.completion", "choices": choices, "usage": usage})

    # --- helpers ------------------------------------------------------------------------
    def _stream(self, envelope: dict, request_id: str, prompts: list[list[int]], params: SamplingParams,
                include_usage: bool, choice: Callable[[_ChoiceDelta], dict],
                first_choices: list[dict] | None = None) -> StreamingResponse:
        """SSE: `first_choices` one event each, then one event per delta (shaped by `choice`), the usage
        if asked for, an error event if the engine dies or the request fails, and [DONE]."""
        cut = asyncio.Event()

        async def events() -> AsyncIterator[str]:
            for first in first_choices or []:
                yield _sse({**envelope, "choices": [first]})
            completion_tokens = 0
            cached_tokens: dict[int, int] = {}  # per prompt
            try:
                async for delta in _deltas(self.engine, request_id, prompts, params, self.max_stream_backlog, cut):
                    completion_tokens += len(delta.token_ids)
                    cached_tokens[delta.prompt_index] = delta.num_cached_tokens
                    yield _sse({**envelope, "choices": [choice(delta)]})
                if include_usage:
                    usage = _usage(prompts, completion_tokens, sum(cached_tokens.values()))
                    yield _sse({**envelope, "choices": [], "usage": usage})
            except EngineDeadError as error:
                yield _sse(_engine_dead(str(error)).body())
            except APIError as error:
                yield _sse(error.body())
            yield _sse("[DONE]")

        return _CuttableStream(events(), cut)

    async def _render_chat(self, body: ChatCompletionRequest) -> list[int]:
        """The conversation templated and tokenized, off the event loop; one too long to fit is refused first."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot chat: use /v1/completions with token ids",
                           "messages")
        conversation = [{"role": m.role, "content": m.text} for m in body.messages]
        chars = sum(len(m["content"]) for m in conversation)
        if chars > self.max_prompt_chars:
            raise APIError(400, f"messages: {chars:,} characters cannot fit in this model's maximum context "
                                f"length of {self.max_model_len} tokens", "messages")
        template = None if getattr(self.tokenizer, "chat_template", None) else DEFAULT_CHAT_TEMPLATE

        def render() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                          add_generation_prompt=body.add_generation_prompt)
            except Exception as error:  # the template rejected the conversation (e.g. role order)
                raise APIError(400, f"the chat template cannot render these messages: {error}", "messages") from None
            self._check_prompt_length(text, "messages")
            # the template writes the special tokens itself
            return self.tokenizer.encode(text, add_special_tokens=False)

        return await asyncio.to_thread(render)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None) -> dict | None:
        if logprobs is None:
            return None
        tokens = [self._token_text(t) for t in token_ids]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [entry[t] for t, entry in zip(token_ids, logprobs)],
            "top_logprobs": [{self._token_text(i): lp for i, lp in entry.items()} for entry in logprobs],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None, top: int) -> dict | None:
        if logprobs is None:
            return None

        def item(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [
            {**item(t, entry[t]),
             "top_logprobs": [item(i, lp) for i, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:top]]}
            for t, entry in zip(token_ids, logprobs)
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


