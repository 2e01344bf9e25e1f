"""The door in front of every route (also the proxy's): the API key, the body's framing, media type, size
and pace, and uvicorn's h11 protocol with deadlines for a request's headers.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import h11
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvshard.entrypoints.openai.protocol import (DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_REQUEST_READ_TIMEOUT,
                                                 APIError)

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
