"""`kvshard proxy --prefill URL... --decode URL...`: one OpenAI front door over producers and consumers.

Each request goes to a producer (round robin) as a one-token prefill that keeps its
KV under a fresh transfer id, then to a consumer (round robin) with where to fetch
that KV; the consumer's answer, streamed or not, is the client's. An error from
either side reaches the client in OpenAI's shape, with the status it came with
(502 when a server cannot be reached).
"""

from __future__ import annotations

import argparse
import itertools
import json
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvshard.config import ConfigError
from kvshard.entrypoints.openai_server import (DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_REQUEST_READ_TIMEOUT, APIError,
                                               RequestDoor)


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


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str],
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
        self._next_prefill = itertools.cycle(self.prefill)
        self._next_decode = itertools.cycle(self.decode)
        self.client: httpx.AsyncClient | None = None
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        async def lifespan(app: FastAPI):
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
            try:
                yield
            finally:
                await self.client.aclose()

        app = FastAPI(title="kvshard proxy", lifespan=lifespan)
        app.add_exception_handler(APIError, lambda request, error: error.response())
        # the servers behind check the API key; the proxy bounds what a request may bring, and how slowly
        app.add_middleware(RequestDoor, max_body_bytes=self.max_request_body_bytes,
                           read_timeout=self.request_read_timeout)
        app.get("/health")(self.health)
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        return app

    async def health(self) -> Response:
        for role, url in [("prefill", u) for u in self.prefill] + [("decode", u) for u in self.decode]:
            try:
                answer = await self.client.get(f"{url}/health")
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
        try:
            body = json.loads(await request.body())
        except ValueError as error:
            raise APIError(400, f"the request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > 1:
            raise APIError(400, "the disaggregated proxy takes one prompt per request", "prompt")
        if body.get("n", 1) != 1:
            raise APIError(400, "the disaggregated proxy serves n=1 only", "n")
        headers = _auth(request)
        transfer_id = uuid.uuid4().hex
        prefill_url, decode_url = next(self._next_prefill), next(self._next_decode)

        # a one-token prefill whose KV the producer keeps for the consumer
        prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        prefill.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id})
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        try:
            answer = await self.client.post(prefill_url + path, json=prefill, headers=headers)
        except httpx.HTTPError as error:
            raise _unreachable("prefill", prefill_url, error) from None
        if answer.status_code != 200:
            return _relay(answer)

        where = urlsplit(prefill_url)
        decode = {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer_id,
                                                 "remote_host": where.hostname, "remote_port": where.port or 80}}
        upstream = self.client.build_request("POST", decode_url + path, json=decode, headers=headers)
        try:
            response = await self.client.send(upstream, stream=bool(body.get("stream")))
        except httpx.HTTPError as error:
            raise _unreachable("decode", decode_url, error) from None
        if not body.get("stream") or response.status_code != 200:
            await response.aread()
            await response.aclose()
            return _relay(response)
        return StreamingResponse(_events(response, decode_url), media_type="text/event-stream")


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
                    "return the decode server's answer. Round robin over several of each.")
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
    proxy = Proxy(args.prefill, args.decode, args.max_request_body_bytes, args.request_read_timeout)
    print(f"kvshard proxy: serving disaggregated at http://{args.host}:{args.port}/v1 "
          f"(prefill: {', '.join(proxy.prefill)}; decode: {', '.join(proxy.decode)})", flush=True)
    uvicorn.Server(uvicorn_config(proxy.app, args, host=args.host, port=args.port, log_level="info")).run()
    return 0
