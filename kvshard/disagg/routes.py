"""The HTTP side of a producer or consumer: `kv_transfer_params` checked at the door, the
`/kv_transfer/*` routes, and the transfer metrics.

Every `/kv_transfer/*` route needs the deployment's shared secret (header `X-KVShard-KV-Secret`) and,
when the server has an API key, the key as well:

- `GET /kv_transfer/info`: role, engine id, layout, KV signature.
- `POST /kv_transfer/pull` (producer): a consumer's fetch of a held request's KV.
- `POST /kv_transfer/release` (producer): `{"transfer_id"}`: the proxy no longer wants that KV.
- `POST /kv_transfer/register` (consumer): `{"engine_id", "url"}`: a producer this consumer may pull from.
- `POST /kv_transfer/check/v1/completions`, `.../v1/chat/completions`: would this server take the
  request? 200 `{}` or the error it would answer, without running anything (the proxy asks the
  consumer before the producer prefills).
"""

from __future__ import annotations

import secrets

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import ValidationError

from kvshard.disagg.connector import FETCH_RESULTS, FREE_REASONS, KVConnector, PullRefused
from kvshard.disagg.params import KVTransferParams, Registration, first_error
from kvshard.disagg.secret import HEADER
from kvshard.entrypoints.openai_server import APIError, OpenAIServer


def check_secret(connector: KVConnector, given: str | None, param: str | None = None) -> None:
    if not secrets.compare_digest((given or "").encode(), connector.secret.encode()):
        raise APIError(403, "this needs the deployment's shared KV-transfer secret (header X-KVShard-KV-Secret), "
                            "which kvshard proxy sends; see docs/disaggregation.md", param, "kv_transfer_forbidden")


def door_check(connector: KVConnector):
    """What `OpenAIServer` runs on a request's `kv_transfer_params` before anything else sees them:
    the secret (403, first: a caller without it learns nothing of the fields), their shape (400 naming
    the field), the role and the producer (400). Returns the checked parameters as a dict."""
    def check(raw: dict, headers) -> dict:
        check_secret(connector, headers.get(HEADER), "kv_transfer_params")
        try:
            params = KVTransferParams.model_validate(raw)
        except ValidationError as error:
            message, field = first_error(error, "kv_transfer_params")
            if field == "kv_transfer_params.remote_host" or field == "kv_transfer_params.remote_port":
                message += ": a consumer pulls only from producers it knows (remote_engine_id)"
            raise APIError(400, message, field) from None
        if params.do_remote_decode == params.do_remote_prefill:
            raise APIError(400, "kv_transfer_params: set exactly one of do_remote_decode (producer) and "
                                "do_remote_prefill (consumer)", "kv_transfer_params")
        role = connector.config.kv_role
        if params.do_remote_decode and not connector.config.is_producer:
            raise APIError(400, f"kv_transfer_params.do_remote_decode: this server is a {role}",
                           "kv_transfer_params.do_remote_decode")
        if params.do_remote_prefill:
            if connector.config.is_producer:
                raise APIError(400, f"kv_transfer_params.do_remote_prefill: this server is a {role}",
                               "kv_transfer_params.do_remote_prefill")
            if params.remote_engine_id is None:
                raise APIError(400, "kv_transfer_params.remote_engine_id is required with do_remote_prefill",
                               "kv_transfer_params.remote_engine_id")
            if params.remote_engine_id not in connector.producers:
                raise APIError(400, f"kv_transfer_params.remote_engine_id: {params.remote_engine_id!r} is not a "
                                    "producer this consumer may pull from (kv_connector_extra_config.producers, "
                                    "or registered by the proxy)", "kv_transfer_params.remote_engine_id")
        return params.model_dump(exclude_none=True)

    return check


class _TransferMetrics:
    """The connector's counts at scrape time."""

    def __init__(self, connector: KVConnector, model_name: str) -> None:
        self.connector, self.model_name = connector, model_name

    def collect(self):
        c, name = self.connector, self.model_name
        holds = GaugeMetricFamily("kvshard:kv_transfer_holds", "Finished prefills whose KV waits for a consumer.",
                                  labels=["model_name"])
        holds.add_metric([name], c.num_holds)
        blocks = GaugeMetricFamily("kvshard:kv_transfer_held_blocks", "KV blocks those holds keep.",
                                   labels=["model_name"])
        blocks.add_metric([name], c.num_held_blocks)
        made = CounterMetricFamily("kvshard:kv_transfer_holds_made", "Holds made (producer).", labels=["model_name"])
        made.add_metric([name], c.holds_total)
        freed = CounterMetricFamily("kvshard:kv_transfer_holds_freed", "Holds ended, by why.",
                                    labels=["model_name", "reason"])
        for reason in FREE_REASONS:
            freed.add_metric([name, reason], c.freed[reason])
        fetches = CounterMetricFamily("kvshard:kv_transfer_fetches", "Fetches of a prompt's KV (consumer), by "
                                      "result.", labels=["model_name", "result"])
        for result in FETCH_RESULTS:
            fetches.add_metric([name, result], c.fetches[result])
        return [holds, blocks, made, freed, fetches]


def attach_kv_transfer(server: OpenAIServer, connector: KVConnector) -> None:
    """Add the `/kv_transfer/*` routes and the transfer metrics to the server, check `kv_transfer_params`
    at its door, and let the connector wake its engine loop."""
    connector.wake = server.engine.wake
    server.check_kv_transfer = door_check(connector)
    server.metrics.registry.register(_TransferMetrics(connector, server.model_names[0]))

    async def authorized(request: Request) -> None:
        await server.check_api_key(request)
        check_secret(connector, request.headers.get(HEADER))

    async def info() -> JSONResponse:
        return JSONResponse(connector.info())

    async def pull(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError as error:
            raise APIError(400, f"malformed pull request: the body is not JSON: {error}") from None
        try:
            return JSONResponse(connector.serve_pull(body))
        except PullRefused as error:
            raise APIError(error.status, str(error), code="kv_transfer_refused") from None

    async def release(request: Request) -> JSONResponse:
        body = await _json_object(request)
        transfer_id = body.get("transfer_id")
        if not isinstance(transfer_id, str) or not 1 <= len(transfer_id) <= 128:
            raise APIError(400, "transfer_id must be a transfer id string", "transfer_id")
        if not connector.config.is_producer:
            raise APIError(400, "this instance is not a kv_producer")
        connector.release(transfer_id)
        return JSONResponse({})

    async def register(request: Request) -> JSONResponse:
        try:
            registration = Registration.model_validate(await _json_object(request))
        except ValidationError as error:
            message, field = first_error(error, "body")
            raise APIError(400, message, field.removeprefix("body.")) from None
        if connector.config.is_producer:
            raise APIError(400, "this instance is not a kv_consumer")
        connector.register(registration.engine_id, registration.url)
        return JSONResponse({})

    async def check_completion(request: Request) -> JSONResponse:
        await server.completion_inputs(request)  # the real route's checks, tokenizing included
        return JSONResponse({})

    async def check_chat(request: Request) -> JSONResponse:
        await server.chat_inputs(request)
        return JSONResponse({})

    guarded = {"dependencies": [Depends(authorized)]}
    server.app.get("/kv_transfer/info", **guarded)(info)
    server.app.post("/kv_transfer/pull", **guarded)(pull)
    server.app.post("/kv_transfer/release", **guarded)(release)
    server.app.post("/kv_transfer/register", **guarded)(register)
    server.app.post("/kv_transfer/check/v1/completions", **guarded)(check_completion)
    server.app.post("/kv_transfer/check/v1/chat/completions", **guarded)(check_chat)


async def _json_object(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body
