"""`kvshard proxy --prefill URL... --decode URL...`: one OpenAI front door over producers and consumers.

Each request is first checked by a consumer (round robin), which answers what it would
answer the request itself; then it goes to a producer (round robin) as a one-token
prefill that keeps its KV under a fresh transfer id, then to the consumer with the
producer's engine id (the consumer learned where that producer is from the proxy's
registration, never from the request); the consumer's answer, streamed or not, is the
client's. Every request upstream carries the deployment's shared secret
(disagg/secret.py). An error from either side reaches the client in OpenAI's shape,
with the status it came with (502 when a server cannot be reached), and so do the
proxy's own (400 for a body kvshard servers refuse). A client that hangs up, streamed
or not, closes both upstream requests (which aborts them), and the producer is told
to free the KV it holds for that request. docs/disaggregation.md has the whole
exchange.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvshard.config import ConfigError
from kvshard.disagg.secret import HEADER, deployment_secret
from kvshard.entrypoints.openai.api_server import _http_error, _internal_error
from kvshard.entrypoints.openai.door import RequestDoor
from kvshard.entrypoints.openai.protocol import (DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_REQUEST_READ_TIMEOUT,
                                                 OUTPUT_CONSTRAINT_FIELDS, APIError)
from kvshard.entrypoints.openai.serving_engine import until_disconnected

# a server's routes that the proxy does not serve, and what to do instead (answered 404 with this said)
NOT_PROXIED = {
    "/v1/responses": "the Responses API keeps each response in the server that made it (previous_response_id), "
                     "which a proxy spreading requests over its consumers cannot honour: send it to a server directly",
    "/tokenize": "tokenize at a server directly (producers and consumers tokenize alike)",
    "/detokenize": "detokenize at a server directly (producers and consumers tokenize alike)",
    "/metrics": "each server has its own /metrics: scrape the producers and consumers",
}

logger = logging.getLogger("kvshard.proxy")


def _unreachable(role: str, url: str, error: Exception) -> APIError:
    return APIError(502, f"the {role} server at {url} cannot be reached: {error}", code="upstream_unreachable",
                    type="server_error")


def _relay(response: httpx.Response) -> Response:
    """An upstream answer as it came, or an OpenAI error if its body is not JSON."""
    try:
        return JSONResponse(response.json(), status_code=response.status_code)
    except ValueError:
        return APIError(502, f"upstream answered {response.status_code}: {response.text[:200]}",
                        type="server_error").response()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:20]} is too large for a number")
    return value


def parse_body(raw: bytes) -> dict:
    """The client's JSON object, refused with 400 as kvshard servers refuse it: not JSON, NaN, Infinity,
    numbers out of range, nesting too deep to parse, lone surrogates."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
        json.dumps(body).encode("utf-8")  # a lone surrogate cannot be sent on
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeError, RecursionError) as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


# Each answer of an upstream's quick routes (/health; /kv_transfer/info, register, check, release) within this
# many seconds, else 502 naming it: a frozen server (SIGSTOP: its port still accepts connections) must not hang
# the proxy's /health or its requests. The prefill and the decode themselves are bounded by their client, who
# may hang up (a long prompt's prefill takes what it takes).
HEALTH_TIMEOUT_S = 5.0
CONTROL_TIMEOUT_S = 30.0


class Proxy:
    """`secret`: the deployment's shared secret (disagg/secret.py); read from the environment or the
    per-user file when not given."""

    def __init__(self, prefill: list[str], decode: list[str], secret: str | None = None,
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT) -> None:
        self.max_request_body_bytes = max_request_body_bytes
        self.request_read_timeout = request_read_timeout
        if not prefill or not decode:
            raise ConfigError("kvshard proxy needs at least one --prefill URL and one --decode URL")
        for url in prefill + decode:
            if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
                raise ConfigError(f"{url!r} is not a server URL: give e.g. http://127.0.0.1:8100")
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self.secret = secret or deployment_secret()
        self._next_prefill = itertools.cycle(self.prefill)
        self._next_decode = itertools.cycle(self.decode)
        self._engine_ids: dict[str, str] = {}  # producer URL -> its engine id
        self._registered: set[tuple[str, str]] = set()  # (producer, consumer) pairs the consumer knows
        self._background: set[asyncio.Task] = set()
        self.client: httpx.AsyncClient | None = None
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        async def lifespan(app: FastAPI):
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
            try:
                yield
            finally:
                await asyncio.gather(*self._background, return_exceptions=True)
                await self.client.aclose()

        app = FastAPI(title="kvshard proxy", lifespan=lifespan)
        app.add_exception_handler(APIError, lambda request, error: error.response())
        app.add_exception_handler(StarletteHTTPException, _http_error)
        app.add_exception_handler(Exception, _internal_error)
        # the servers behind check the API key; the proxy bounds what a request may bring, and how slowly
        app.add_middleware(RequestDoor, max_body_bytes=self.max_request_body_bytes,
                           read_timeout=self.request_read_timeout)
        app.get("/health")(self.health)
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        for path, why in NOT_PROXIED.items():
            app.api_route(path, methods=["GET", "POST"])(_not_proxied(path, why))
        return app

    async def health(self) -> Response:
        for role, url in [("prefill", u) for u in self.prefill] + [("decode", u) for u in self.decode]:
            try:
                answer = await self.client.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S)
            except httpx.HTTPError as error:
                return _unreachable(role, url, error).response()
            if answer.status_code != 200:
                return _relay(answer)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        url = next(self._next_decode)
        try:
            return _relay(await self.client.get(f"{url}/v1/models", headers=_auth(request)))
        except httpx.HTTPError as error:
            raise _unreachable("decode", url, error) from None

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/chat/completions")

    async def _generate(self, request: Request, path: str) -> Response:
        body = parse_body(await request.body())
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > 1:
            raise APIError(400, "the disaggregated proxy takes one prompt per request", "prompt")
        if body.get("n", 1) != 1:
            raise APIError(400, "the disaggregated proxy serves n=1 only", "n")
        if "kv_transfer_params" in body:
            raise APIError(400, "kv_transfer_params is set by the proxy, not by its clients", "kv_transfer_params")
        prefill_url, decode_url = next(self._next_prefill), next(self._next_decode)
        transfer_id = uuid.uuid4().hex
        state = {"prefilled": False, "fetched": False}

        async def run() -> Response:
            return await self._disaggregate(request, path, body, prefill_url, decode_url, transfer_id, state)

        # a client that hangs up, streamed or not, cancels what runs for it: both sides see it go
        task = await until_disconnected(request, run())
        if state["prefilled"] and (task.cancelled() or task.exception() is not None or not state["fetched"]):
            self._release(prefill_url, transfer_id, request)  # nobody will fetch that KV
        if task.cancelled():
            return Response(status_code=499)  # the client is gone
        return task.result()

    async def _disaggregate(self, request: Request, path: str, body: dict, prefill_url: str, decode_url: str,
                            transfer_id: str, state: dict) -> Response:
        headers = {**_auth(request), HEADER: self.secret}
        engine_id = await self._producer_id(prefill_url, headers)
        if not isinstance(engine_id, str):
            return engine_id  # the producer's answer: an error
        registered = await self._register(prefill_url, decode_url, engine_id, headers)
        if registered is not None:
            return registered
        decode = {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer_id,
                                                 "remote_engine_id": engine_id}}
        # the consumer checks the request first: what it would refuse costs the producer nothing
        check = await self._check(decode_url, path, decode, headers)
        if check.status_code != 200 and _error_param(check) == "kv_transfer_params.remote_engine_id":
            # the consumer restarted and forgot the producer: tell it again, once
            self._registered.discard((prefill_url, decode_url))
            registered = await self._register(prefill_url, decode_url, engine_id, headers)
            if registered is not None:
                return registered
            check = await self._check(decode_url, path, decode, headers)
        if check.status_code != 200:
            return _relay(check)

        # a one-token prefill whose KV the producer keeps for the consumer
        # (its token is thrown away: no output constraint to compile there, the consumer samples under it; the
        # constraint fields do not change the prompt, and the tools, which do, stay)
        prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options", *OUTPUT_CONSTRAINT_FIELDS)}
        prefill.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id})
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        state["prefilled"] = True  # from here the producer may hold KV for this request
        try:
            answer = await self.client.post(prefill_url + path, json=prefill, headers=headers)
        except httpx.HTTPError as error:
            raise _unreachable("prefill", prefill_url, error) from None
        if answer.status_code != 200:
            return _relay(answer)

        upstream = self.client.build_request("POST", decode_url + path, json=decode, headers=headers)
        try:
            response = await self.client.send(upstream, stream=bool(body.get("stream")))
        except httpx.HTTPError as error:
            raise _unreachable("decode", decode_url, error) from None
        if not body.get("stream") or response.status_code != 200:
            try:
                await response.aread()
            finally:
                await response.aclose()
            state["fetched"] = response.status_code == 200
            return _relay(response)
        state["fetched"] = True  # a stream that started has its KV
        return StreamingResponse(_events(response, decode_url), media_type="text/event-stream")

    async def _check(self, decode_url: str, path: str, decode: dict, headers: dict) -> httpx.Response:
        try:
            return await self.client.post(f"{decode_url}/kv_transfer/check{path}", json=decode, headers=headers,
                                          timeout=CONTROL_TIMEOUT_S)
        except httpx.HTTPError as error:
            raise _unreachable("decode", decode_url, error) from None

    async def _producer_id(self, url: str, headers: dict) -> str | Response:
        if url not in self._engine_ids:
            try:
                answer = await self.client.get(f"{url}/kv_transfer/info", headers=headers, timeout=CONTROL_TIMEOUT_S)
            except httpx.HTTPError as error:
                raise _unreachable("prefill", url, error) from None
            if answer.status_code != 200:
                return _relay(answer)
            try:
                info = answer.json()
                engine_id = info["engine_id"]
                assert info["kv_role"] == "kv_producer" and isinstance(engine_id, str)
            except (ValueError, KeyError, TypeError, AssertionError):
                raise APIError(502, f"the prefill server at {url} is not a kv_producer", type="server_error") from None
            self._engine_ids[url] = engine_id
        return self._engine_ids[url]

    async def _register(self, prefill_url: str, decode_url: str, engine_id: str, headers: dict) -> Response | None:
        """The consumer learns where this producer answers pulls (once per pair)."""
        if (prefill_url, decode_url) in self._registered:
            return None
        try:
            answer = await self.client.post(f"{decode_url}/kv_transfer/register", headers=headers,
                                            json={"engine_id": engine_id, "url": prefill_url}, timeout=CONTROL_TIMEOUT_S)
        except httpx.HTTPError as error:
            raise _unreachable("decode", decode_url, error) from None
        if answer.status_code != 200:
            return _relay(answer)
        self._registered.add((prefill_url, decode_url))
        return None

    def _release(self, prefill_url: str, transfer_id: str, request: Request) -> None:
        """The producer frees the KV it may hold for this request (nobody will fetch it); in the
        background, so that a client that left does not wait for it."""
        async def release() -> None:
            try:
                await self.client.post(f"{prefill_url}/kv_transfer/release", json={"transfer_id": transfer_id},
                                       headers={**_auth(request), HEADER: self.secret}, timeout=CONTROL_TIMEOUT_S)
            except httpx.HTTPError as error:
                logger.warning("releasing %s at %s failed: %s", transfer_id, prefill_url, error)

        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _error_param(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return None


async def _events(response: httpx.Response, url: str) -> AsyncIterator[bytes]:
    """The consumer's event stream, with an error event if it breaks off."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as error:
        failure = APIError(502, f"the decode server at {url} broke off the stream: {error}",
                           code="upstream_broke_off", type="server_error")
        yield f"data: {json.dumps(failure.body())}\n\ndata: [DONE]\n\n".encode()
    finally:
        await response.aclose()


def _auth(request: Request) -> dict[str, str]:
    given = request.headers.get("authorization")
    return {"authorization": given} if given else {}


def add_proxy_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "proxy", help="OpenAI front door for disaggregated prefill (producers) and decode (consumers)",
        description="Send each request to a prefill server (started with --kv-transfer-config "
                    "'{\"kv_role\": \"kv_producer\"}'), hand its KV to a decode server (kv_consumer), and "
                    "return the decode server's answer. Round robin over several of each. The proxy and the "
                    "servers share the deployment's secret: $KVSHARD_KV_TRANSFER_SECRET, or one generated per "
                    "user and machine (docs/disaggregation.md).")
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="producer base URLs")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="consumer base URLs")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    from kvshard.entrypoints.serve import add_door_args

    add_door_args(parser, serve=False)
    parser.set_defaults(func=run_proxy)


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    if not 0 <= args.port < 2**16:
        raise ConfigError(f"--port {args.port} is not a TCP port: use 0..65535")
    from kvshard.entrypoints.serve import check_door_args, uvicorn_config

    check_door_args(args)
    proxy = Proxy(args.prefill, args.decode, max_request_body_bytes=args.max_request_body_bytes,
                  request_read_timeout=args.request_read_timeout)
    print(f"kvshard proxy: serving disaggregated at http://{args.host}:{args.port}/v1 "
          f"(prefill: {', '.join(proxy.prefill)}; decode: {', '.join(proxy.decode)})", flush=True)
    uvicorn.Server(uvicorn_config(proxy.app, args, host=args.host, port=args.port, log_level="info")).run()
    return 0


def _not_proxied(path: str, why: str):
    async def answer() -> Response:
        return APIError(404, f"kvshard proxy does not serve {path}: {why}").response()

    return answer
